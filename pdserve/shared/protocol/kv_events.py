"""Block events on the wire: what a pod tells the block registry about its prefix cache.

A pod's engine reports ``stored``/``removed`` block hashes (``BlockPool.take_events``). The pod numbers
every event with a sequence number that only grows (per pod and per ``epoch`` — one epoch per worker
process, so a restarted pod under the same name starts afresh) and POSTs them in batches:

    POST /v1/kv/events     body KVEventBatch   -> 200 KVEventsReply
    POST /v1/kv/snapshot   body KVSnapshot     -> 200 KVEventsReply
    POST /v1/kv/lookup     body KVLookup       -> 200 KVLookupReply

The registry applies events exactly once and in order. An event it cannot place (a gap: events lost,
a registry that forgot the pod, a new epoch not starting at 1) makes it answer ``resync: true``; the pod
then sends a :class:`KVSnapshot` — its whole current hash set as of sequence number ``seq`` — which
replaces what the registry holds. Events up to ``seq`` are then moot; later ones apply on top.
Same scheme as vLLM's KV-event publisher (``KVEventBatch`` with a sequence number; gap -> replay/resync)
and NVIDIA Dynamo's KV router indexer.

Block hashes travel as lowercase hex of the engine's 16-byte hashes (``pdserve/shared/protocol/block_hash.py``).
Each event names its ``medium`` (vLLM's ``BlockStored.medium``): ``device`` (the KV pool's prefix cache) or an
offloading tier, ``cpu`` or ``disk`` (docs/engine.md "KV offloading tiers"); the registry keeps one set per pod
and medium, and a lookup reports how many leading blocks each pod holds in each.
"""

from __future__ import annotations

from typing import Annotated, Literal, Sequence

from pydantic import BaseModel, Field, StringConstraints

from pdserve.shared.protocol.registry import POD_ID_PATTERN, PodInfo, Role

HEX_HASH_PATTERN = r"^(?:[0-9a-f]{2}){1,64}$"
HexHash = Annotated[str, StringConstraints(pattern=HEX_HASH_PATTERN)]
Medium = Literal["device", "cpu", "disk"]
MEDIUMS: tuple[str, ...] = ("device", "cpu", "disk")  # best first: a block held in several counts in the first
# Bounds of one request body: a batch is a few engine steps' events; a snapshot is one pod's cache.
MAX_EVENTS_PER_BATCH = 100_000
MAX_HASHES_PER_REQUEST = 4_000_000
MAX_LOOKUP_BLOCKS = 100_000


class KVEvent(BaseModel):
    """One engine event: ``stored`` (blocks entered the prefix cache) or ``removed`` (evicted)."""

    seq: int = Field(ge=1)
    kind: Literal["stored", "removed"]
    block_hashes: list[HexHash] = Field(max_length=MAX_HASHES_PER_REQUEST)
    # the stored chain's parent block (informational: the registry keeps a set per pod)
    parent_hash: HexHash | None = None
    medium: Medium = "device"


class KVEventBatch(BaseModel):
    pod_id: str = Field(pattern=POD_ID_PATTERN)
    epoch: str = Field(min_length=1, max_length=64)
    events: list[KVEvent] = Field(max_length=MAX_EVENTS_PER_BATCH)


class KVSnapshot(BaseModel):
    """The pod's whole prefix-cache hash set after its event ``seq`` (0: before any event)."""

    pod_id: str = Field(pattern=POD_ID_PATTERN)
    epoch: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)
    block_hashes: list[HexHash] = Field(max_length=MAX_HASHES_PER_REQUEST)
    # what the pod's offloading tiers hold (empty without tiers)
    cpu_block_hashes: list[HexHash] = Field(default_factory=list, max_length=MAX_HASHES_PER_REQUEST)
    disk_block_hashes: list[HexHash] = Field(default_factory=list, max_length=MAX_HASHES_PER_REQUEST)


class KVEventsReply(BaseModel):
    """``seq``: the last sequence number the registry has applied for the pod; ``resync``: send a snapshot."""

    applied: int = 0
    seq: int = 0
    resync: bool = False


class KVLookup(BaseModel):
    """A request's chain of full-block hashes (``compute_block_hashes``), first block first."""

    block_hashes: list[HexHash] = Field(max_length=MAX_LOOKUP_BLOCKS)
    role: Role = "decode"


class PodOverlap(BaseModel):
    """An alive pod's load (its last heartbeat) and ``overlap``: how many leading blocks of the chain its KV pool
    holds. ``tier_overlap``: over the leading blocks it holds in any medium, how many each medium is the best
    one for (``{"device": 3, "cpu": 2, "disk": 0}``); empty from a registry that does not index tiers."""

    pod: PodInfo
    overlap: int = Field(ge=0)
    tier_overlap: dict[Medium, int] = Field(default_factory=dict)


class KVLookupReply(BaseModel):
    pods: list[PodOverlap]
    # alive prefill pods, so the router needs no second call to decide remote vs local prefill
    num_prefill_pods: int = 0


def encode_lookup_reply(pods: Sequence[tuple[bytes, int, dict[str, int]]], num_prefill_pods: int) -> bytes:
    """A ``KVLookupReply`` as ``model_dump_json`` writes it, from each pod's ``PodInfo`` JSON (``model_dump_json``),
    overlap and tier overlap: the registry's answer to every lookup lists every alive pod, and splicing the pods'
    JSON (parsed and written once per heartbeat) costs a fraction of building and serializing the models."""
    parts = [b'{"pod":%s,"overlap":%d,"tier_overlap":{%s}}' % (
        pod_json, overlap, b",".join(b'"%s":%d' % (medium.encode(), n) for medium, n in tiers.items()))
        for pod_json, overlap, tiers in pods]
    return b'{"pods":[%s],"num_prefill_pods":%d}' % (b",".join(parts), num_prefill_pods)
