"""Redis key, stream and channel names of the ensemble (docs/design.md §3): one definition for every service.

Every key carries a Redis Cluster hash tag, ``pdserve:{TAG}:...``: Redis hashes only the text between the
first ``{`` and ``}``, so keys with one tag share a slot, and each multi-key command, Lua script, MULTI and
XREAD below touches one slot (a cluster refuses anything else with CROSSSLOT). The tag says what a key belongs
to, which is also how the load spreads over the shards:
  ``{q-<tier>}``        a tier's shared queue (the prefill stream);
  ``{p-<pod_id>}``      one pod's keys: its own request stream, its registry record and block index;
  ``{r-<router_id>}``   one router incarnation's keys: its liveness key and the output streams and abort
                        markers of the requests it relays (the router reads all of them in one XREAD, and a
                        worker's output script checks the abort marker beside the stream);
  ``{o-<request_id>}``  a request no router named (tests, tools), or a stored response (``{s-<id>}``);
  ``{g}``               small shared keys read whole (the alive sets, the unreachable-pods hash).
A request id minted by a router ends in ``ROUTER_SEP`` + the router id (``owned_request_id``), so every key of
that request is derived from its id alone, by readers and writers alike.

Streams:
  ``PREFILL_STREAM``             the prefill queue (consumer group ``prefill``); entries are ``PrefillRequest``.
  ``decode_stream(pod_id)``      a decode pod's own queue, for requests it prefills itself (local prefill, or no
                                 prefill tier); entries are ``PrefillRequest``; group ``DECODE_GROUP``.
  ``output_stream(request_id)``  one request's output; entries are ``OutputEvent``, written with
                                 ``OutputWriter`` of pdserve/shared/worker/output_writer.py (skips aborted requests, refreshes the TTL
                                 ``OUTPUT_TTL_S`` on every event); the router deletes it once it has read the
                                 final event. Only requests that name no router (``PrefillRequest.router_id``)
                                 use it: a router's own requests come back on its relay stream.
  ``pdserve:{r-<router_id>}:relay``  a router incarnation's relay stream (``relay_stream``): each entry is one
                                 ``OutputBatch`` -- one decode (or prefill) step's events for every request of
                                 that router on that pod -- written with one pipelined XADD per step per router
                                 (``RelayPublisher``); the router reads it with one XREAD and trims what it read.
                                 Hash-tagged by router, so a Redis Cluster keeps each router's stream in one slot.
Keys:
  ``router_key(router_id)``      a live router incarnation (TTL ``ROUTER_TTL_S``); requests name it as their owner.
  ``response_key(id)``           a stored ``/v1/responses`` response and its conversation (JSON; TTL the router's
                                 ``responses_ttl_s``).
  ``pod_key``, ``alive_key``, ``blocks_key``, ``seq_key``, ``tier_keys``: the registry's (pdserve/services/registry).
Abort:
  channel ``ABORT_CHANNEL`` carries a request id (a cluster broadcasts PUBLISH to every node); key
  ``aborted_key(request_id)`` (TTL ``ABORTED_TTL_S``) lets a worker that was not subscribed at publish time (or
  dequeues the request later) see it too.
"""

from __future__ import annotations

PREFIX = "pdserve:"

PREFILL_STREAM = "pdserve:{q-prefill}:queue"
PREFILL_GROUP = "prefill"
DECODE_GROUP = "decode"

ABORT_CHANNEL = "pdserve:abort"

# A router refreshes its incarnation's key every ROUTER_TTL_S / 3; a decode pod drops the requests of a router
# whose key stayed missing for ORPHAN_AFTER_S (checked while Redis answers: a flushed key is back in seconds).
ROUTER_TTL_S = 6
ORPHAN_AFTER_S = 4.0

# The router deletes an output stream when it has read the final event; the TTL bounds memory when no one does
# (router gone, client gone before the worker finished).
OUTPUT_TTL_S = 60
# A relay stream nobody reads (its router gone) expires after RELAY_TTL_S; a writer refreshes the TTL once per
# RELAY_TTL_S / 3 per stream (not per entry), and caps it at about RELAY_MAXLEN entries (XADD MAXLEN ~) so a
# router that stopped reading cannot grow it without bound in the meantime.
RELAY_TTL_S = 60
RELAY_MAXLEN = 20000
ABORTED_TTL_S = 300

# Hash: decode pod id -> unix time until which routers avoid it, set by a prefill pod whose KV transfer to it
# timed out or lost its connection, deleted by the next transfer that succeeds. The key expires with its newest entry.
KV_UNREACHABLE = "pdserve:{g}:kv_unreachable"

# Between a router-minted request id and the id of the router that relays it (``owned_request_id``).
ROUTER_SEP = "@"


def tag(scope: str) -> str:
    """The key prefix of everything in hash-tag scope ``scope`` (``pdserve:{scope}:``)."""
    return f"pdserve:{{{scope}}}:"


def owned_request_id(stem: str, router_id: str) -> str:
    """The id a router gives a request it relays: its keys then share the router's slot (module doc)."""
    return f"{stem}{ROUTER_SEP}{router_id}"


def request_tag(request_id: str) -> str:
    """The hash-tag scope of a request's keys: its router's (``owned_request_id``), else its own. A migrated
    copy (``<id>~m<n>``) keeps its router's."""
    stem, sep, owner = request_id.rpartition(ROUTER_SEP)
    owner = owner.split("~", 1)[0]
    return f"r-{owner}" if sep and stem and owner else f"o-{request_id}"


def decode_stream(pod_id: str) -> str:
    """The decode pod's own request stream (local prefill)."""
    return f"{tag('p-' + pod_id)}queue"


def output_stream(request_id: str) -> str:
    """The per-request output stream the workers write ``OutputEvent``s to."""
    return f"{tag(request_tag(request_id))}out:{request_id}"


# SCAN patterns (operators and tests): every request's output stream, every decode pod's own stream.
OUTPUT_STREAMS_MATCH = "pdserve:{*}:out:*"
DECODE_STREAMS_MATCH = "pdserve:{p-*}:queue"


def output_stream_request(name: str | bytes) -> str:
    """The request id of the output stream ``name`` (the inverse of ``output_stream``)."""
    text = name.decode() if isinstance(name, bytes) else name
    return text.split("}:out:", 1)[1]


def relay_stream(router_id: str) -> str:
    """The relay stream of router incarnation ``router_id``: ``OutputBatch`` entries for all its requests."""
    return f"{tag('r-' + router_id)}relay"


def router_key(router_id: str) -> str:
    """Exists (TTL ``ROUTER_TTL_S``) while the router incarnation ``router_id`` runs."""
    return f"{tag('r-' + router_id)}alive"


def response_key(response_id: str) -> str:
    """A stored ``/v1/responses`` response (``store``), for GET, DELETE and ``previous_response_id``."""
    return f"{tag('s-' + response_id)}response"


def aborted_key(request_id: str) -> str:
    """Set (TTL ``ABORTED_TTL_S``) when a request was aborted; workers check it before starting work."""
    return f"{tag(request_tag(request_id))}aborted:{request_id}"


# The registry's keys. A pod's record, block sets and sequence record share the pod's slot (one script per
# heartbeat, one Lua script per event batch); the alive set of a role is one key the registry reads whole.
def pod_key(pod_id: str) -> str:
    """Hash: one JSON-encoded value per ``PodInfo`` field (TTL the registry's ``pod_ttl_s``)."""
    return f"{tag('p-' + pod_id)}pod"


def alive_key(role: str) -> str:
    """Sorted set pod_id -> last heartbeat (Redis server time, unix s) of the pods of ``role``."""
    return f"{tag('g')}alive:{role}"


def blocks_key(pod_id: str) -> str:
    """Set of the pod's cached block hashes (16 raw bytes each) in its KV pool."""
    return f"{tag('p-' + pod_id)}kv:blocks"


def tier_keys(pod_id: str, mediums: tuple[str, ...] = ("cpu", "disk")) -> list[str]:
    """The pod's block sets of the offloading tiers, beside ``blocks_key`` (the pool's)."""
    return [f"{blocks_key(pod_id)}:{medium}" for medium in mediums]


def seq_key(pod_id: str) -> str:
    """Hash {epoch, seq}: the pod's worker process and its last applied block event."""
    return f"{tag('p-' + pod_id)}kv:seq"


def redact_url(url: str) -> str:
    """``url`` with its password (``redis://:secret@host``) replaced by ``***``: what logs and banners show."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


def enqueued_at(entry_id: bytes | str) -> float:
    """When a Redis stream entry was added (unix s): its id is ``<milliseconds>-<sequence>``."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-", 1)[0]) / 1000
