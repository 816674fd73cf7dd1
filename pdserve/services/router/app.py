"""The router's FastAPI app: wiring only. ``create_app(settings)`` connects Redis and the registry at startup,
builds the services and puts them on ``app.state``, and installs the guards, error handlers and routes.

What a request goes through: ``routes.py`` (HTTP) -> ``serving.CompletionService`` (plan, admit, dispatch,
relay, finish; limits in ``admission.py``) -> ``delivery.py`` (JSON body or SSE stream); beside them
``params`` (validation), ``prompts`` (tokenization), ``dispatch`` (pod choice, enqueue), ``relay`` (output
streams, abort), ``responses`` (OpenAI bodies and chunks).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.shared.models.resolve import resolve_model
from pdserve.shared import redis_client
from pdserve.shared.protocol import keys

from . import errors
from .admission import Admission
from .dispatch import DispatchConfig, Dispatcher, PodDirectory
from .drain import Drain, DrainGate
from .errors import OpenAIError
from .metrics import RouterMetrics
from .middleware import GuardMiddleware, StatusCounter
from .models import ServedModel
from .relay_reader import RelayReader
from .pod_probe import probe_client
from .params import generation_defaults
from .prompts import PromptProcessor, read_chat_template
from .router_id import balanced_router_id
from .routes import router as routes
from .serving import CompletionService, RouterState
from .settings import RouterSettings
from .tokenization import TokenizationService

logger = logging.getLogger("pdserve.router")
# How long a Redis command waits for a pooled connection when all are in use before it fails (ConnectionError,
# which the relay retries like an outage); a relay's XREAD gives its connection back within a second.
REDIS_POOL_WAIT_S = 20.0
JSON_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"})
COUNTED_PATHS = JSON_PATHS | {"/v1/models", "/health", "/metrics", "/version"}


def connect_redis(settings: RouterSettings) -> Redis:
    """Connection errors are retried with backoff (~6 s): a Redis restart costs a pause, not a 503. Every request
    in flight holds a pooled connection while its relay blocks in XREAD, so the pool is sized for the requests in
    flight and waits for a free connection when full: redis-py's default pool (100 connections,
    MaxConnectionsError at once when exhausted) turned an abort storm of 200 clients into 503s "Redis is
    unavailable" while Redis was fine."""
    return redis_client.connect(settings.redis_url, pool=(settings.redis_max_connections, REDIS_POOL_WAIT_S),
                                retries=6)


async def announce(redis: Redis, router_id: str) -> None:
    """Keep this router incarnation's key alive (``keys.router_key``) until cancelled; Redis errors are retried."""
    while True:
        try:
            await redis.set(keys.router_key(router_id), b"1", ex=keys.ROUTER_TTL_S)
        except RedisError as exc:
            logger.debug("announcing router %s failed: %s", router_id, exc)
        await asyncio.sleep(keys.ROUTER_TTL_S / 3)


def start_services(app: FastAPI, settings: RouterSettings, processor: PromptProcessor, redis: Redis,
                   directory: PodDirectory, router_id: str | None = None) -> RouterState:
    """Build the dispatcher and the services over ``redis`` and ``directory``; put them on ``app.state``.
    ``router_id``: this incarnation's id (default: a random one)."""
    metrics, router_id = app.state.metrics, router_id or uuid.uuid4().hex
    dispatcher = Dispatcher(redis, directory, DispatchConfig.from_settings(settings), metrics, router_id=router_id)
    admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests,
                          settings.max_queued_prompt_tokens, settings.retry_after_s)
    state = RouterState(settings=settings, processor=processor, redis=redis, dispatcher=dispatcher, metrics=metrics,
                        defaults=generation_defaults(processor.model_dir), admission=admission, router_id=router_id,
                        http=probe_client(), output_streams=RelayReader(redis, router_id))
    model = ServedModel(settings.served_name, settings.model, processor.max_model_len, state.created)
    app.state.router, app.state.model = state, model
    app.state.service = CompletionService(state, model, app.state.drain)
    app.state.tokenization = TokenizationService(processor, model, dispatcher)
    return state


def add_guards(app: FastAPI, settings: RouterSettings) -> None:
    app.add_middleware(GuardMiddleware, api_keys=settings.api_keys, max_body_bytes=settings.max_body_bytes,
                       json_paths=JSON_PATHS, body_timeout_s=settings.http_body_timeout_s)
    app.add_middleware(DrainGate, drain=app.state.drain)  # outside the key check: a draining router says so to all
    # Added last = outermost: it also counts the guard's 401s and 413s.
    app.add_middleware(StatusCounter, counter=app.state.metrics.requests, paths=COUNTED_PATHS)

    async def redis_error_handler(request: Request, exc: RedisError) -> JSONResponse:
        return await errors.openai_error_handler(request, errors.redis_unavailable(exc, settings.retry_after_s))

    app.add_exception_handler(OpenAIError, errors.openai_error_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(RedisError, redis_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)


def create_app(settings: RouterSettings | None = None, processor: PromptProcessor | None = None,
               directory: PodDirectory | None = None) -> FastAPI:
    """Build the router app. ``processor`` and ``directory`` default to the model's tokenizer and a
    ``RegistryClient(settings.registry_url)``; tests pass their own to share a loaded tokenizer."""
    settings = settings or RouterSettings()
    processor = processor or PromptProcessor(resolve_model(settings.model), settings.max_model_len,
                                             read_chat_template(settings.chat_template))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = connect_redis(settings)
        owned = None
        if directory is None:
            from pdserve.shared.registry_client import RegistryClient
            owned = RegistryClient(settings.registry_url, token=settings.registry_token)
        try:
            router_id = await balanced_router_id(redis)
        except RedisError as exc:  # Redis not up yet: a random id serves as well, only spread by chance
            logger.warning("could not read the live routers (%s): taking a random router id", exc)
            router_id = None
        state = start_services(app, settings, processor, redis, directory or owned, router_id)
        alive = asyncio.create_task(announce(redis, state.router_id))
        logger.info("router serving %s (max_model_len %d), redis %s, registry %s", settings.served_name,
                    processor.max_model_len, keys.redact_url(settings.redis_url), settings.registry_url)
        try:
            yield
        finally:
            alive.cancel()
            try:
                # what is left is orphaned now; nobody reads this incarnation's relay stream any more
                await redis.delete(keys.router_key(state.router_id), keys.relay_stream(state.router_id))
            except RedisError:
                pass
            if owned is not None:
                await owned.aclose()
            await state.http.aclose()
            await state.output_streams.aclose()
            await redis.aclose()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.metrics = RouterMetrics(settings.served_name)
    # SIGTERM drains (``DrainingServer`` runs it); before the lifespan starts nothing is in flight
    app.state.drain = Drain(settings.shutdown_grace_s, settings.retry_after_s,
                            lambda: getattr(getattr(app.state, "router", None), "active", 0))
    add_guards(app, settings)
    app.include_router(routes)
    return app
