"""The registry's HTTP routes: pods (heartbeats, listing, deregistration), block events and prefix lookups,
health and metrics. Each handler makes one call into ``PodStore`` / ``BlockIndex`` (on ``app.state``)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from pdserve.shared.protocol.kv_events import (KVEventBatch, KVEventsReply, KVLookup, KVLookupReply, KVSnapshot,
                                               encode_lookup_reply)
from pdserve.shared.protocol.registry import ROLES, PodInfo, Role

from .errors import error_body
from .kv_index import BlockIndex
from .metrics import RegistryMetrics
from .store import PodStore

log = logging.getLogger("pdserve.registry")
router = APIRouter()


def _store(request: Request) -> PodStore:
    return request.app.state.store


def _index(request: Request) -> BlockIndex:
    return request.app.state.index


def _metrics(request: Request) -> RegistryMetrics:
    return request.app.state.metrics


@router.post("/v1/pods")
async def heartbeat(info: PodInfo, request: Request) -> dict:
    stored = await _store(request).heartbeat(info)
    _metrics(request).heartbeats.labels(info.role).inc()
    return stored.model_dump(mode="json")


@router.get("/v1/pods")
async def list_pods(request: Request, role: Role | None = Query(None)) -> dict:
    return {"pods": [p.model_dump(mode="json") for p in await _store(request).list(role)]}


@router.get("/v1/pods/{pod_id}")
async def get_pod(pod_id: str, request: Request):
    pod = await _store(request).get(pod_id)
    if pod is None:
        return error_body(404, f"no pod {pod_id!r} is registered", "not_found_error", "pod_id")
    return pod.model_dump(mode="json")


@router.delete("/v1/pods/{pod_id}")
async def deregister(pod_id: str, request: Request):
    if not await _store(request).delete(pod_id):
        return error_body(404, f"no pod {pod_id!r} is registered", "not_found_error", "pod_id")
    _metrics(request).deregistrations.inc()
    log.info("registry: %s deregistered", pod_id)
    return {"deleted": True}


@router.post("/v1/kv/events")
async def kv_events(batch: KVEventBatch, request: Request) -> KVEventsReply:
    reply = await _index(request).apply(batch)
    metrics = _metrics(request)
    metrics.kv_events.inc(reply.applied)
    if reply.resync:
        metrics.kv_resyncs.inc()
        log.info("registry: %s needs a KV resync (events from %d, registry at %d)", batch.pod_id,
                 batch.events[0].seq if batch.events else 0, reply.seq)
    return reply


@router.post("/v1/kv/snapshot")
async def kv_snapshot(snap: KVSnapshot, request: Request) -> KVEventsReply:
    reply = await _index(request).snapshot(snap)
    _metrics(request).kv_snapshots.inc()
    log.info("registry: %s resynchronised: %d blocks as of event %d", snap.pod_id, len(snap.block_hashes), snap.seq)
    return reply


@router.get("/v1/kv/pods/{pod_id}")
async def kv_pod(pod_id: str, request: Request) -> dict:
    """The pod's indexed hashes and last applied event (operators, tests)."""
    index = _index(request)
    epoch, seq = await index.pod_seq(pod_id)
    return {"pod_id": pod_id, "epoch": epoch, "seq": seq, "block_hashes": sorted(await index.pod_blocks(pod_id))}


@router.post("/v1/kv/lookup", response_model=KVLookupReply)
async def kv_lookup(q: KVLookup, request: Request) -> Response:
    start = time.perf_counter()
    pods, num_prefill = await _store(request).alive(q.role, count="prefill" if q.role == "decode" else None)
    overlaps = await _index(request).overlaps([p.pod_id for p, _ in pods], q.block_hashes)
    body = encode_lookup_reply([(pod_json, overlap, tiers) for (_, pod_json), (overlap, tiers) in zip(pods, overlaps)],
                               num_prefill if q.role == "decode" else len(pods))
    metrics = _metrics(request)
    metrics.kv_lookups.inc()
    metrics.kv_lookup_seconds.observe(time.perf_counter() - start)
    return Response(body, media_type="application/json")


@router.get("/health")
async def health(request: Request):
    try:
        await request.app.state.redis.ping()
    except (RedisError, OSError) as e:
        return JSONResponse({"status": "unavailable", "reason": f"redis: {type(e).__name__}: {e}"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    metrics, index = _metrics(request), _index(request)
    try:
        pods = await _store(request).list()
        for role in ROLES:
            mine = [p for p in pods if p.role == role]
            metrics.pods.labels(role).set(len(mine))
            metrics.free_blocks.labels(role).set(sum(p.free_blocks for p in mine))
        metrics.kv_blocks.clear()
        for p in pods:
            metrics.kv_blocks.labels(p.pod_id, p.role).set(await index.count(p.pod_id))
        metrics.redis_up.set(1)
    except RedisError:
        metrics.redis_errors.inc()
        metrics.redis_up.set(0)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
