"""The router's FastAPI app: the path of a request through validation, placement, the queue and the relay.

``create_app(settings)`` builds it; the business logic lives in ``params`` (validation), ``prompts``
(tokenization), ``dispatch`` (pod choice, enqueue), ``relay`` (output streams, abort) and ``responses``
(OpenAI bodies and chunks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import RedisError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.shared.models.resolve import resolve_model
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest

from . import errors
from .dispatch import Dispatcher, PodDirectory, RoutingConfig
from .drain import Drain, DrainGate
from .errors import OpenAIError
from .metrics import RouterMetrics
from .middleware import GuardMiddleware, StatusCounter
from .tenancy import tenant_cache_salt
from .params import (RequestPlan, build_sampling_params, check_context, check_cross_field, echo_only, echo_prefixes,
                     generation_defaults, requested_max_tokens)
from .prompts import PromptProcessor, prompt_count
from .migration import Migrator, health_url
from .prefill_watch import PrefillWatch
from .relay import ChoiceRoute, OutputRelay, abort_requests
from .responses import ResponseBuilder
from .schemas import (REQUEST_ID_PATTERN, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                      TokenizeCompletionRequest)
from .settings import RouterSettings

logger = logging.getLogger("pdserve.router")
REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
# How long a Redis command waits for a pooled connection when all are in use before it fails (ConnectionError,
# which the relay retries like an outage); a relay's XREAD gives its connection back within a second.
REDIS_POOL_WAIT_S = 20.0


@dataclass(slots=True)
class RouterState:
    settings: RouterSettings
    processor: PromptProcessor
    redis: Redis
    dispatcher: Dispatcher
    metrics: RouterMetrics
    defaults: dict[str, Any]
    created: int = field(default_factory=lambda: int(time.time()))
    active: int = 0  # requests between submit and finish
    queued: int = 0  # admitted choices (prompts x n) not decoding yet (in a queue, in prefill, or waiting for a
    # decode slot): what --max-queued-requests bounds, so a list of prompts counts each of them
    queued_tokens: int = 0  # their prompt tokens
    # This incarnation, named in every request it enqueues: decode pods drop the requests of a router gone
    router_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(slots=True)
class Job:
    """One accepted OpenAI request after enqueueing: its choices' request ids and where they went."""

    response_id: str
    request_ids: list[str]
    pods: list[str]
    arrival: float
    builder: ResponseBuilder
    closed: bool = False
    routes: list[ChoiceRoute] = field(default_factory=list)  # per choice: its current request and tokens sent
    # choice index -> its prompt tokens, for the choices counted in RouterState.queued until they are decoding
    waiting: dict[int, int] = field(default_factory=dict)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown"


def _debug_enabled() -> bool:
    return logger.isEnabledFor(logging.DEBUG)


async def _announce(redis: Redis, router_id: str) -> None:
    """Keep this router incarnation's key alive (``keys.router_key``) until cancelled; Redis errors are retried."""
    while True:
        try:
            await redis.set(keys.router_key(router_id), b"1", ex=keys.ROUTER_TTL_S)
        except RedisError as exc:
            logger.debug("announcing router %s failed: %s", router_id, exc)
        await asyncio.sleep(keys.ROUTER_TTL_S / 3)


class _ChoiceTiming:
    """Router-side TTFT / ITL / TPOT / E2E of one choice."""

    __slots__ = ("arrival", "first", "last")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None

    def on_event(self, metrics: RouterMetrics, event: OutputEvent) -> None:
        now = time.monotonic()
        if event.token_ids:
            if self.first is None:
                self.first = now
                metrics.ttft.observe(now - self.arrival)
            elif self.last is not None:
                metrics.itl.observe(now - self.last)
            self.last = now
        if event.finished:
            metrics.e2e.observe(now - self.arrival)
            if self.first is not None and event.completion_tokens > 1:
                metrics.tpot.observe((now - self.first) / (event.completion_tokens - 1))


class _ClosingEventSource(EventSourceResponse):
    """An SSE response that runs ``on_close`` when it ends however it ends: a client that leaves before the
    first chunk cancels the response before the generator ever runs, so the generator's ``finally`` alone
    would miss the abort."""

    def __init__(self, content: AsyncIterator[str], on_close: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


def create_app(settings: RouterSettings | None = None, processor: PromptProcessor | None = None,
               directory: PodDirectory | None = None) -> FastAPI:
    """Build the router app. ``processor`` and ``directory`` default to the model's tokenizer and a
    ``RegistryClient(settings.registry_url)``; tests pass their own to share a loaded tokenizer."""
    settings = settings or RouterSettings()
    if processor is None:
        processor = PromptProcessor(resolve_model(settings.model), settings.max_model_len)
    defaults = generation_defaults(processor.model_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal directory
        # connection errors are retried with backoff (~6 s): a Redis restart costs a pause, not a 503.
        # Every request in flight holds a pooled connection while its relay blocks in XREAD, so the pool is
        # sized for the requests in flight and waits for a free connection when full: redis-py's default pool
        # (100 connections, MaxConnectionsError at once when exhausted) turned an abort storm of 200 clients
        # into 503s "Redis is unavailable" while Redis was fine.
        pool = BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.redis_max_connections, timeout=REDIS_POOL_WAIT_S,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 6),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        redis = Redis.from_pool(pool)
        owns_directory = directory is None
        if directory is None:
            from pdserve.shared.registry_client import RegistryClient
            directory = RegistryClient(settings.registry_url, token=settings.registry_token)
        app.state.router = RouterState(
            settings=settings, processor=processor, redis=redis,
            dispatcher=Dispatcher(redis, directory, settings.registry_cache_s,
                                  settings.local_prefill_threshold, settings.retry_after_s,
                                  RoutingConfig(settings.routing_mode, settings.routing_load_weight,
                                                settings.routing_temperature), app.state.metrics,
                                  fallback_max_tokens=settings.local_prefill_fallback_max_tokens),
            metrics=app.state.metrics, defaults=defaults)
        alive = asyncio.create_task(_announce(redis, app.state.router.router_id))
        logger.info("router serving %s (max_model_len %d), redis %s, registry %s", settings.served_name,
                    processor.max_model_len, keys.redact_url(settings.redis_url), settings.registry_url)
        try:
            yield
        finally:
            alive.cancel()
            try:
                await redis.delete(keys.router_key(app.state.router.router_id))  # what is left is orphaned now
            except RedisError:
                pass
            close = getattr(directory, "aclose", None) or getattr(directory, "close", None)
            if owns_directory and close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
            await redis.aclose()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.metrics = RouterMetrics(settings.served_name)
    # SIGTERM drains (``DrainingServer`` runs it); before the lifespan starts nothing is in flight
    app.state.drain = Drain(settings.shutdown_grace_s, settings.retry_after_s,
                            lambda: getattr(getattr(app.state, "router", None), "active", 0))
    app.add_middleware(GuardMiddleware, api_keys=settings.api_keys, max_body_bytes=settings.max_body_bytes,
                       json_paths=frozenset({"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}),
                       body_timeout_s=settings.http_body_timeout_s)
    app.add_middleware(DrainGate, drain=app.state.drain)  # outside the key check: a draining router says so to all
    # Added last = outermost: it also counts the guard's 401s and 413s.
    app.add_middleware(StatusCounter, counter=app.state.metrics.requests,
                       paths={"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize",
                              "/health", "/metrics", "/version"})
    app.add_exception_handler(OpenAIError, errors.openai_error_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)

    async def redis_error_handler(request: Request, exc: RedisError) -> JSONResponse:
        return await errors.openai_error_handler(request, errors.redis_unavailable(exc, settings.retry_after_s))

    app.add_exception_handler(RedisError, redis_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)

    def state(request: Request) -> RouterState:
        return request.app.state.router

    # ---- model / health / metrics ------------------------------------------------------------

    async def model_card(st: RouterState) -> dict[str, Any]:
        return {"id": settings.served_name, "object": "model", "created": st.created, "owned_by": "pdserve",
                "root": settings.model, "parent": None,
                "max_model_len": await st.dispatcher.context_limit(processor.max_model_len), "permission": []}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [await model_card(state(request))]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        """OpenAI's ``models.retrieve``: the served model's card (by its served name or ``--model``), else 404."""
        check_model(model)
        return await model_card(state(request))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            # bounded: the client retries connection errors for seconds, /health must answer now
            await asyncio.wait_for(state(request).redis.ping(), 2.0)
        except Exception as exc:
            reason = "no answer within 2 s" if isinstance(exc, asyncio.TimeoutError) else str(exc)
            return JSONResponse({"status": "unavailable", "reason": f"redis: {reason}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        st = state(request)
        try:
            st.metrics.queue_depth.set(await st.redis.xlen(keys.PREFILL_STREAM))
        except Exception:
            pass  # Redis down: the other metrics are still worth scraping
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- tokenizer endpoints (vLLM's shapes) --------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name not in (settings.served_name, settings.model):
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise errors.bad_request(f"Malformed JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise errors.bad_request("Request body must be a JSON object")
        return body

    def parse(model_cls: type, body: dict[str, Any]) -> Any:
        try:
            return model_cls.model_validate(body)
        except ValidationError as exc:
            errs = exc.errors()
            message, param = errors.describe_validation_error({**errs[0], "loc": ("body", *errs[0]["loc"])})
            raise errors.bad_request(message, param) from exc

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        if "messages" in body:
            req = parse(TokenizeChatRequest, body)
            check_model(req.model)
            ids = await anyio.to_thread.run_sync(lambda: processor.chat_token_ids(
                req.messages, req.add_generation_prompt, req.continue_final_message,
                req.chat_template_kwargs, req.add_special_tokens))
        else:
            req = parse(TokenizeCompletionRequest, body)
            check_model(req.model)
            ids = await anyio.to_thread.run_sync(
                lambda: processor.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        # the limit requests are held to (a decode pod's smaller KV cache lowers it), as /v1/models reports it
        limit = await state(request).dispatcher.context_limit(processor.max_model_len)
        return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse(DetokenizeRequest, await json_body(request))
        check_model(req.model)
        processor.check_token_ids(req.tokens, "tokens")
        return {"prompt": processor.decode(req.tokens)}

    # ---- generation --------------------------------------------------------------------------

    async def plan(req: ChatCompletionRequest | CompletionRequest) -> RequestPlan:
        check_model(req.model)
        check_cross_field(req)
        processor.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        if isinstance(req, ChatCompletionRequest):
            ids = await anyio.to_thread.run_sync(lambda: processor.chat_token_ids(
                req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
                tools=req.tools))
            prompts, prompt_param = [ids], "messages"
        else:
            listed = prompt_count(req.prompt)
            if listed > settings.max_prompts_per_request:
                raise errors.bad_request(f"prompt lists {listed} prompts; at most {settings.max_prompts_per_request} "
                                         "are accepted in one request (--max-prompts-per-request)", "prompt")
            prompts = await anyio.to_thread.run_sync(
                lambda: processor.prompt_token_ids(req.prompt, req.add_special_tokens))
            prompt_param = "prompt"
        max_tokens, max_param = requested_max_tokens(req)
        limit = await app.state.router.dispatcher.context_limit(processor.max_model_len)
        sampling = []
        for ids in prompts:
            effective = check_context(len(ids), max_tokens, limit, prompt_param, max_param)
            sampling.append(build_sampling_params(req, effective, defaults))
        return RequestPlan(prompts=prompts, sampling=sampling, n=req.n)

    async def submit(request: Request, req: ChatCompletionRequest | CompletionRequest, kind: str) -> Job:
        st = state(request)
        arrival_wall, arrival = time.time(), time.monotonic()
        p = await plan(req)
        limit = settings.max_concurrent_requests
        retry = {"Retry-After": str(max(settings.retry_after_s, 1))}
        if limit and st.active >= limit:
            raise OpenAIError(429, f"The server is serving its limit of {limit} concurrent requests; retry later",
                              headers=retry)
        # Admission on what is not decoding yet: bounded queues keep admitted requests' latency bounded under
        # overload (the surplus is told to come back instead of queueing without end). See ``started_decoding``
        # for why the first token is not the end of the queue. Every choice (prompt x n) is one queued request.
        new_tokens = sum(len(ids) for ids in p.prompts) * p.n
        total = len(p.prompts) * p.n
        max_queued = settings.max_queued_requests
        if max_queued and total > max_queued:  # could never be admitted: not worth a retry
            raise errors.bad_request(
                f"This request has {total} choices ({len(p.prompts)} prompts x n={p.n}); the server queues at most "
                f"{max_queued} at once (--max-queued-requests): send fewer prompts or a smaller n",
                "prompt" if len(p.prompts) > 1 else "n")
        if max_queued and st.queued + total > max_queued:
            raise OpenAIError(429, f"{st.queued} requests are waiting for prefill or a decode slot (limit "
                                   f"{max_queued}); retry later", headers=retry)
        if settings.max_queued_prompt_tokens and st.queued and \
                st.queued_tokens + new_tokens > settings.max_queued_prompt_tokens:
            raise OpenAIError(429, f"{st.queued_tokens} prompt tokens are waiting for prefill or a decode slot "
                                   f"(limit {settings.max_queued_prompt_tokens}); retry later", headers=retry)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        header_id = request.headers.get("x-request-id")
        client_id = req.request_id or (header_id if header_id and REQUEST_ID_RE.match(header_id) else None)
        response_id = f"{prefix}-{client_id or uuid.uuid4().hex}"
        # A client may reuse its id (retries): internal ids must stay unique, they name the output streams.
        stem = f"{response_id}-{uuid.uuid4().hex[:8]}" if client_id else response_id
        request_ids = [stem] if total == 1 else [f"{stem}-{i}" for i in range(total)]
        pods: list[str] = []
        want_logprobs = bool(req.logprobs) if kind == "chat" else req.logprobs is not None
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        builder = ResponseBuilder(kind, response_id, settings.served_name, int(arrival_wall),
                                  processor.token_str, [len(ids) for ids in p.prompts], p.n, want_logprobs,
                                  include_usage=include_usage,
                                  continuous_usage=bool(req.stream_options
                                                        and req.stream_options.continuous_usage_stats),
                                  prompt_tokens_details=settings.enable_prompt_tokens_details,
                                  echo=echo_prefixes(req, p.prompts, processor.decode), echo_only=echo_only(req),
                                  num_logprobs=(req.logprobs or 0) if kind != "chat" else 0,
                                  prompt_logprobs=req.prompt_logprobs,
                                  token_bytes=processor.token_bytes)
        job = Job(response_id, request_ids, pods, arrival, builder,
                  waiting={i: len(p.prompts[i // p.n]) for i in range(total)})
        st.active += 1
        st.queued += total
        st.queued_tokens += new_tokens
        st.metrics.running.inc()
        cache_salt = tenant_cache_salt(req.cache_salt, getattr(request.state, "api_key_id", None)) \
            if settings.cache_salt_per_api_key else req.cache_salt
        try:
            for prompt_index, ids in enumerate(p.prompts):
                placement = await st.dispatcher.place(len(ids), ids, cache_salt)
                pod = placement.pod
                choices = [PrefillRequest(
                    request_id=request_ids[prompt_index * p.n + j], model=settings.model,
                    prompt_token_ids=ids, sampling_params=p.choice_params(prompt_index, j),
                    decode_pod_id=pod.pod_id, decode_host=pod.host, decode_kv_port=int(pod.kv_port),
                    arrival_time=arrival_wall, deadline=None, cache_salt=cache_salt,
                    priority=req.priority, choice_index=prompt_index * p.n + j, router_id=st.router_id)
                    for j in range(p.n)]
                stream, entries = await st.dispatcher.enqueue(placement, choices)
                pods.extend([pod.pod_id] * p.n)
                job.routes.extend(ChoiceRoute(c.request_id, pod.pod_id, c.prompt_token_ids, c.sampling_params,
                                              c.cache_salt, c.priority, pod_health_url=health_url(pod),
                                              pod_started_at=getattr(pod, "started_at", None),
                                              queue_stream=stream, queue_entry=entry)
                                  for c, entry in zip(choices, entries))
                st.metrics.pd_decisions.labels(settings.served_name,
                                               "local" if placement.local_prefill else "remote").inc(p.n)
                logger.info("request %s: %d prompt tokens, n=%d -> decode pod %s (%s prefill)", response_id,
                            len(ids), p.n, pod.pod_id, "local" if placement.local_prefill else "remote")
                if _debug_enabled():
                    logger.debug("request %s prompt ids %s params %s", response_id, ids, choices[0].sampling_params)
        except BaseException:
            # Choices already queued (a batch whose later prompt found no pod) must not run.
            await finish(st, job, aborted=bool(pods), reason="enqueue_failed")
            raise
        return job

    async def finish(st: RouterState, job: Job, aborted: bool, reason: str = "client_disconnected") -> None:
        """Release the job's bookkeeping; when ``aborted``, tell every worker to drop it (shielded: this
        runs while the request's task is being cancelled)."""
        if job.closed:
            return
        job.closed = True
        dequeue(st, job)
        with anyio.CancelScope(shield=True):
            st.active -= 1
            st.metrics.running.dec()
            if aborted:
                st.metrics.aborted.labels(settings.served_name, reason).inc()
                logger.info("request %s aborted (%s)", job.response_id, reason)
                try:
                    await abort_requests(st.redis, job.request_ids)
                except Exception as exc:
                    logger.error("request %s: abort failed: %s", job.response_id, exc)
            for pod_id in set(job.pods):
                st.dispatcher.finished(pod_id, job.pods.count(pod_id))
            job.pods.clear()

    def started_decoding(event: OutputEvent) -> bool:
        """Whether this choice has left every queue. Not its first token: a prefill pod samples that before the
        KV hand-over, and the hand-over waits (reservation retries, the exported KV held in the prefill pod's
        memory) until the decode pod has free blocks. Counting requests as queued only until their first token
        let them pile up there without limit at 10x load (admitted latency grew for as long as the overload
        lasted); the second token comes from the decode pod's running batch."""
        return event.finished or event.error is not None or event.completion_tokens >= 2

    def dequeue(st: RouterState, job: Job, choices: Any = None) -> None:
        """Stop counting ``choices`` (default: all) of ``job`` as queued."""
        for index in list(job.waiting) if choices is None else choices:
            tokens = job.waiting.pop(index, None)
            if tokens is not None:
                st.queued -= 1
                st.queued_tokens -= tokens

    def record_finish(st: RouterState, job: Job) -> None:
        st.metrics.prompt_tokens.inc(sum(job.builder.prompt_lens))
        st.metrics.prompt_tokens_cached.inc(job.builder.cached_tokens)
        for c in job.builder.choices:
            st.metrics.generation_tokens.inc(c.completion_tokens)
            st.metrics.success.labels(settings.served_name, c.finish_reason or "error").inc()

    async def events(st: RouterState, job: Job) -> AsyncIterator[tuple[int, OutputEvent]]:
        timings = [_ChoiceTiming(job.arrival) for _ in job.request_ids]
        try:
            migrate = Migrator(st.redis, st.dispatcher, job, settings.model, settings.max_migrations,
                               settings.migration_pod_gone_wait_s,
                               lambda reason: st.metrics.migrations.labels(
                                   settings.served_name, "error" if reason.startswith("worker") else "stall").inc(),
                               router_id=st.router_id)
            watch = PrefillWatch(st.redis, st.dispatcher, settings.prefill_stall_s, settings.retry_after_s) \
                if settings.prefill_stall_s else None
            relay = OutputRelay(st.redis, job.routes, settings.request_timeout_s, settings.migration_stall_s,
                                migrate if settings.migration_stall_s else None,
                                redis_retry_s=settings.redis_retry_s,
                                stop=(app.state.drain.expired, app.state.drain.error), watch=watch)
            async for index, event in relay:
                if index in job.waiting and started_decoding(event):
                    dequeue(st, job, (index,))
                timings[index].on_event(st.metrics, event)
                if event.error is not None:
                    err = event.error
                    raise OpenAIError(int(err.get("code") or 500), str(err.get("message", "worker error")),
                                      err.get("param"), err_type=err.get("type"))
                yield index, event
        except RedisError as exc:
            raise errors.redis_unavailable(exc, settings.retry_after_s) from exc

    async def respond(request: Request, job: Job) -> JSONResponse:
        st = state(request)

        async def collect() -> None:
            async for index, event in events(st, job):
                job.builder.on_event(index, event)

        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collector.done():
                await finish(st, job, aborted=True)
                return JSONResponse(errors.error_body(499, "Client disconnected"), status_code=499)
            try:
                collector.result()  # raises the worker's or the relay's error
            except OpenAIError as exc:
                await finish(st, job, aborted=True, reason=exc.type)
                raise
            record_finish(st, job)
            await finish(st, job, aborted=False)
            return JSONResponse(job.builder.response())
        finally:
            watcher.cancel()
            collector.cancel()
            await finish(st, job, aborted=True, reason="cancelled")  # no-op unless cancelled from outside

    def stream(request: Request, job: Job) -> EventSourceResponse:
        st = state(request)
        include_usage = job.builder.include_usage

        async def chunks() -> AsyncIterator[str]:
            complete = False
            try:
                try:
                    async for index, event in events(st, job):
                        for chunk in job.builder.stream_chunks(index, event):
                            yield json.dumps(chunk, ensure_ascii=False)
                except OpenAIError as exc:
                    await finish(st, job, aborted=True, reason=exc.type)
                    complete = True
                    yield json.dumps(exc.body(), ensure_ascii=False)
                    yield "[DONE]"
                    return
                if include_usage:
                    yield json.dumps(job.builder.usage_chunk(), ensure_ascii=False)
                complete = True
                record_finish(st, job)
                await finish(st, job, aborted=False)
                yield "[DONE]"
            finally:
                if not complete:
                    await finish(st, job, aborted=True)

        # Only data lines unless keep-alive comments are asked for (settings.sse_ping_s): see pdserve.loadtest.sse.
        return _ClosingEventSource(chunks(), lambda: finish(st, job, aborted=True), sep="\n",
                                   ping=settings.sse_ping_s)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        job = await submit(request, body, "chat")
        return stream(request, job) if body.stream else await respond(request, job)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        job = await submit(request, body, "completion")
        return stream(request, job) if body.stream else await respond(request, job)

    return app
