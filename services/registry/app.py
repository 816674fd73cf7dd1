"""The registry's HTTP API (FastAPI): heartbeats and block events in, alive pods and prefix overlaps out.

API: shared/protocol/registry.py (pods, authentication) and shared/protocol/kv_events.py (block events, lookup).
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.services.registry.kv_index import BlockIndex
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.kv_events import KVEventBatch, KVEventsReply, KVLookup, KVLookupReply, KVSnapshot, PodOverlap
from pdserve.shared.protocol.registry import ROLES, TOKEN_ENV, PodInfo, Role, check_token
from pdserve.services.registry.settings import RegistrySettings
from pdserve.services.registry.store import PodStore

log = logging.getLogger("pdserve.registry")


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


# Probes and scrapers carry no token (kubelet, Prometheus); these answer without one.
OPEN_PATHS = frozenset({"/health", "/metrics"})
_REFUSAL_LOG_EVERY_S = 10.0


class BearerAuth:
    """ASGI guard: every path but :data:`OPEN_PATHS` needs ``Authorization: Bearer <token>``.

    Runs before routing and body parsing, so an unauthenticated caller learns nothing (not even a 400
    or 404). Refusals: 401, ``WWW-Authenticate: Bearer``, the registry's error body with ``code``
    ``missing_token`` (no bearer credentials) or ``invalid_token`` (another token). The comparison is
    constant-time; neither token is ever logged.
    """

    def __init__(self, app: ASGIApp, token: str, metrics: _Metrics) -> None:
        self.app = app
        self._token = token.encode()
        self._metrics = metrics
        self._logged_at = float("-inf")
        self._unlogged = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, presented = auth.partition(b" ")
        presented = presented.strip()
        if scheme.lower() != b"bearer" or not presented:
            reason = "missing_token"
            message = f"registry authentication required: send 'Authorization: Bearer <token>' ({TOKEN_ENV})"
        elif not hmac.compare_digest(presented, self._token):
            reason = "invalid_token"
            message = f"registry token refused: it is not this registry's token ({TOKEN_ENV})"
        else:
            await self.app(scope, receive, send)
            return
        self._metrics.auth_failures.labels(reason).inc()
        self._log_refusal(scope, reason)
        response = error_body(401, message, "authentication_error", code=reason,
                              headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _log_refusal(self, scope: Scope, reason: str) -> None:
        # A scanner or a misconfigured pod can refuse thousands of times a minute: one line per interval.
        now = time.monotonic()
        if now - self._logged_at < _REFUSAL_LOG_EVERY_S:
            self._unlogged += 1
            return
        client = scope.get("client") or ("?", 0)
        more = f" ({self._unlogged} more refused since the last such line)" if self._unlogged else ""
        log.warning("registry: refused %s %s from %s: %s%s", scope["method"], scope["path"], client[0], reason, more)
        self._logged_at, self._unlogged = now, 0


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.heartbeats = Counter("pdserve:registry_heartbeats_total", "Heartbeats received", ["role"], registry=r)
        self.deregistrations = Counter("pdserve:registry_deregistrations_total", "Pods deregistered", registry=r)
        self.redis_errors = Counter("pdserve:registry_redis_errors_total", "Requests failed on Redis", registry=r)
        self.pods = Gauge("pdserve:registry_pods", "Alive pods (at scrape time)", ["role"], registry=r)
        self.kv_events = Counter("pdserve:registry_kv_events_total", "Block events applied", registry=r)
        self.kv_resyncs = Counter("pdserve:registry_kv_resyncs_total",
                                  "Resyncs asked of pods (sequence gap, unknown pod or epoch)", registry=r)
        self.kv_snapshots = Counter("pdserve:registry_kv_snapshots_total", "Snapshots applied", registry=r)
        self.kv_lookups = Counter("pdserve:registry_kv_lookups_total", "Prefix lookups answered", registry=r)
        self.kv_blocks = Gauge("pdserve:registry_kv_blocks", "Blocks indexed per alive pod (at scrape time)",
                               ["pod", "role"], registry=r)
        self.free_blocks = Gauge("pdserve:registry_free_blocks", "Free KV blocks reported by alive pods",
                                 ["role"], registry=r)
        self.auth_failures = Counter("pdserve:registry_auth_failures_total",
                                     "Requests refused with 401 (reason: missing_token, invalid_token)", ["reason"],
                                     registry=r)


def create_app(settings: RegistrySettings | None = None) -> FastAPI:
    settings = settings or RegistrySettings()
    # a pooled connection that died with a Redis restart is retried at once on a fresh one; a real outage
    # still answers 503 quickly (callers have a 2 s timeout and their own backoff)
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.redis_max_connections, timeout=2, socket_timeout=2,
        socket_connect_timeout=2, retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError])
    redis = aioredis.Redis.from_pool(pool)
    store = PodStore(redis, settings.pod_ttl_s)
    index = BlockIndex(redis, settings.pod_ttl_s)
    metrics = _Metrics()
    token = check_token(settings.auth_token)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("registry: redis %s, pod TTL %.1f s", keys.redact_url(settings.redis_url), settings.pod_ttl_s)
        if token is None:
            log.warning("registry: UNAUTHENTICATED (%s unset): anyone who can reach this port can register or "
                        "remove pods and ask which prompts are cached; set a token outside local development",
                        TOKEN_ENV)
        else:
            log.info("registry: bearer token required on every path but %s", ", ".join(sorted(OPEN_PATHS)))
        yield
        await redis.aclose()

    app = FastAPI(title="pdserve registry", lifespan=lifespan)
    if token is not None:
        app.add_middleware(BearerAuth, token=token, metrics=metrics)
    app.state.store = store
    app.state.index = index
    app.state.settings = settings

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return error_body(400, f"{param or 'request'}: {err.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(RedisError)
    async def redis_down(request: Request, exc: RedisError) -> JSONResponse:
        metrics.redis_errors.inc()
        log.warning("registry: redis error on %s %s: %s", request.method, request.url.path, exc)
        return error_body(503, f"registry storage unavailable: {type(exc).__name__}", "service_unavailable",
                          code="redis_unavailable", headers={"Retry-After": "1"})

    @app.post("/v1/pods")
    async def heartbeat(info: PodInfo) -> dict:
        stored = await store.heartbeat(info)
        metrics.heartbeats.labels(info.role).inc()
        return stored.model_dump(mode="json")

    @app.get("/v1/pods")
    async def list_pods(role: Role | None = Query(None)) -> dict:
        return {"pods": [p.model_dump(mode="json") for p in await store.list(role)]}

    @app.get("/v1/pods/{pod_id}")
    async def get_pod(pod_id: str):
        pod = await store.get(pod_id)
        if pod is None:
            return error_body(404, f"no pod {pod_id!r} is registered", "not_found_error", "pod_id")
        return pod.model_dump(mode="json")

    @app.delete("/v1/pods/{pod_id}")
    async def deregister(pod_id: str):
        if not await store.delete(pod_id):
            return error_body(404, f"no pod {pod_id!r} is registered", "not_found_error", "pod_id")
        metrics.deregistrations.inc()
        log.info("registry: %s deregistered", pod_id)
        return {"deleted": True}

    @app.post("/v1/kv/events")
    async def kv_events(batch: KVEventBatch) -> KVEventsReply:
        reply = await index.apply(batch)
        metrics.kv_events.inc(reply.applied)
        if reply.resync:
            metrics.kv_resyncs.inc()
            log.info("registry: %s needs a KV resync (events from %d, registry at %d)", batch.pod_id,
                     batch.events[0].seq if batch.events else 0, reply.seq)
        return reply

    @app.post("/v1/kv/snapshot")
    async def kv_snapshot(snap: KVSnapshot) -> KVEventsReply:
        reply = await index.snapshot(snap)
        metrics.kv_snapshots.inc()
        log.info("registry: %s resynchronised: %d blocks as of event %d", snap.pod_id, len(snap.block_hashes),
                 snap.seq)
        return reply

    @app.get("/v1/kv/pods/{pod_id}")
    async def kv_pod(pod_id: str) -> dict:
        """The pod's indexed hashes and last applied event (operators, tests)."""
        epoch, seq = await index.pod_seq(pod_id)
        return {"pod_id": pod_id, "epoch": epoch, "seq": seq, "block_hashes": sorted(await index.pod_blocks(pod_id))}

    @app.post("/v1/kv/lookup")
    async def kv_lookup(q: KVLookup) -> KVLookupReply:
        pods = await store.list(q.role)
        overlaps = await index.overlaps([p.pod_id for p in pods], q.block_hashes)
        num_prefill = len(await store.list("prefill")) if q.role == "decode" else len(pods)
        metrics.kv_lookups.inc()
        return KVLookupReply(pods=[PodOverlap(pod=p, overlap=o) for p, o in zip(pods, overlaps)],
                             num_prefill_pods=num_prefill)

    @app.get("/health")
    async def health():
        try:
            await redis.ping()
        except (RedisError, OSError) as e:
            return JSONResponse({"status": "unavailable", "reason": f"redis: {type(e).__name__}: {e}"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            pods = await store.list()
            for role in ROLES:
                mine = [p for p in pods if p.role == role]
                metrics.pods.labels(role).set(len(mine))
                metrics.free_blocks.labels(role).set(sum(p.free_blocks for p in mine))
            metrics.kv_blocks.clear()
            for p in pods:
                metrics.kv_blocks.labels(p.pod_id, p.role).set(await index.count(p.pod_id))
        except RedisError:
            metrics.redis_errors.inc()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
