"""Redis key, stream and channel names of the ensemble (docs/design.md §3): one definition for every service.

Streams:
  ``pdserve:prefill``            the prefill queue (consumer group ``prefill``); entries are ``PrefillRequest``.
  ``pdserve:decode:{pod_id}``    a decode pod's own queue, for requests it prefills itself (local prefill, or no
                                 prefill tier); entries are ``PrefillRequest``; group ``DECODE_GROUP``.
  ``pdserve:out:{request_id}``   one request's output; entries are ``OutputEvent``, written with
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
  ``pdserve:router:{router_id}`` a live router incarnation (TTL ``ROUTER_TTL_S``); requests name it as their owner.
  ``pdserve:response:{id}``      a stored ``/v1/responses`` response and its conversation (JSON; TTL the router's
                                 ``responses_ttl_s``).
Abort:
  channel ``pdserve:abort`` carries a request id; key ``pdserve:aborted:{request_id}`` (TTL ``ABORTED_TTL_S``)
  lets a worker that was not subscribed at publish time (or dequeues the request later) see it too.
"""

from __future__ import annotations

PREFIX = "pdserve:"

PREFILL_STREAM = "pdserve:prefill"
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
KV_UNREACHABLE = "pdserve:kv_unreachable"


def decode_stream(pod_id: str) -> str:
    """The decode pod's own request stream (local prefill)."""
    return f"pdserve:decode:{pod_id}"


def output_stream(request_id: str) -> str:
    """The per-request output stream the workers write ``OutputEvent``s to."""
    return f"pdserve:out:{request_id}"


def relay_stream(router_id: str) -> str:
    """The relay stream of router incarnation ``router_id``: ``OutputBatch`` entries for all its requests."""
    return f"pdserve:{{r-{router_id}}}:relay"


def router_key(router_id: str) -> str:
    """Exists (TTL ``ROUTER_TTL_S``) while the router incarnation ``router_id`` runs."""
    return f"pdserve:router:{router_id}"


def response_key(response_id: str) -> str:
    """A stored ``/v1/responses`` response (``store``), for GET, DELETE and ``previous_response_id``."""
    return f"pdserve:response:{response_id}"


def aborted_key(request_id: str) -> str:
    """Set (TTL ``ABORTED_TTL_S``) when a request was aborted; workers check it before starting work."""
    return f"pdserve:aborted:{request_id}"


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
