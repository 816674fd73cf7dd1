"""The registry's HTTP API (FastAPI): heartbeats and block events in, alive pods and prefix overlaps out.

Wiring only: ``routes.py`` (handlers), ``store.py`` (pods), ``kv_index.py`` (block index), ``auth.py`` (bearer
token), ``errors.py``, ``metrics.py``. API: pdserve/shared/protocol/registry.py (pods, authentication) and
pdserve/shared/protocol/kv_events.py (block events, lookup).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError

from pdserve.services.registry import errors
from pdserve.services.registry.auth import OPEN_PATHS, BearerAuth
from pdserve.services.registry.kv_index import BlockIndex
from pdserve.services.registry.metrics import RegistryMetrics
from pdserve.services.registry.routes import router as routes
from pdserve.services.registry.settings import RegistrySettings
from pdserve.services.registry.store import PodStore
from pdserve.shared import redis_client
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.registry import TOKEN_ENV, check_token

log = logging.getLogger("pdserve.registry")


def connect_redis(settings: RegistrySettings) -> aioredis.Redis:
    """A pooled connection that died with a Redis restart is retried at once on a fresh one; a real outage still
    answers 503 quickly (callers have a 2 s timeout and their own backoff)."""
    return redis_client.connect(settings.redis_url, pool=(settings.redis_max_connections, 2), retries=2,
                                backoff_s=0.05, backoff_cap_s=0.2, socket_timeout=2, socket_connect_timeout=2)


def create_app(settings: RegistrySettings | None = None) -> FastAPI:
    settings = settings or RegistrySettings()
    redis = connect_redis(settings)
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
    app.state.settings, app.state.redis, app.state.metrics = settings, redis, RegistryMetrics()
    app.state.store = PodStore(redis, settings.pod_ttl_s)
    app.state.index = BlockIndex(redis, settings.pod_ttl_s)
    if token is not None:
        app.add_middleware(BearerAuth, token=token, metrics=app.state.metrics)
    app.add_exception_handler(RequestValidationError, errors.invalid)
    app.add_exception_handler(RedisError, errors.redis_down)
    app.include_router(routes)
    return app
