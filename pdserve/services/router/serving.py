"""The request lifecycle of ``/v1/chat/completions`` and ``/v1/completions`` (vLLM's ``OpenAIServingChat`` /
``OpenAIServingCompletion``): ``CompletionService`` plans a request (validation, tokenization), admits it
(``admission.py``: concurrency and queue limits), dispatches its choices (``Dispatcher.dispatch``), relays
their output events (``OutputRelay``, with migration and the prefill watch) and finishes it (counters, abort).
How the events become a JSON body or an SSE stream is ``delivery.py``'s.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.responses import Response

from pdserve.shared import tracing
from pdserve.shared.logs import request_id as log_request_id
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent

from . import delivery, errors
from .admission import Admission
from .dispatch import ChoiceSpec, Dispatcher
from .drain import Drain
from .errors import OpenAIError
from .inflight import JobTable
from .metrics import ChoiceTiming, RouterMetrics
from .migration import Migrator, health_url
from .relay_reader import RelayReader
from .models import ServedModel
from .params import (RequestPlan, build_sampling_params, check_context, check_cross_field, echo_only, echo_prefixes,
                     requested_max_tokens)
from .prefill_watch import PrefillWatch
from .prompts import PromptProcessor, prompt_count
from .relay import ChoiceRoute, OutputRelay, abort_requests
from .responses import ResponseBuilder
from .schemas import REQUEST_ID_PATTERN, ChatCompletionRequest, CompletionRequest
from .settings import RouterSettings
from .tenancy import tenant_cache_salt
from .tool_calls import guided_schema, tool_plan

logger = logging.getLogger("pdserve.router")
REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)

GenerationRequest = ChatCompletionRequest | CompletionRequest


@dataclass(slots=True)
class RouterState:
    """The router's collaborators (one per app)."""

    settings: RouterSettings
    processor: PromptProcessor
    redis: Redis
    dispatcher: Dispatcher
    metrics: RouterMetrics
    defaults: dict[str, Any]
    admission: Admission
    created: int = field(default_factory=lambda: int(time.time()))
    # This incarnation, named in every request it enqueues: decode pods drop the requests of a router gone
    router_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # one client for the pods' own HTTP ports (pod_probe.py); None: each probe makes its own (tests)
    http: httpx.AsyncClient | None = None
    # one XREAD of this router's relay stream for every relay (relay_reader.py); None: each relay reads the
    # per-request output streams itself (requests that name no router)
    output_streams: RelayReader | None = None
    jobs: JobTable = field(default_factory=JobTable)  # the jobs being served (GET /v1/pdserve/requests)

    @property
    def active(self) -> int:
        """Requests between submit and finish (what a shutdown waits for)."""
        return self.admission.active


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
    # choice index -> its prompt tokens, for the choices counted in Admission.queued until they are decoding
    waiting: dict[int, int] = field(default_factory=dict)
    span: Any = None  # the request's root span (pdserve/shared/tracing.py); None: not traced


def started_decoding(event: OutputEvent) -> bool:
    """Whether this choice has left every queue (``Admission`` stops counting it). Not its first token: a
    prefill pod samples that before the KV hand-over, and the hand-over waits (reservation retries, the exported
    KV held in the prefill pod's memory) until the decode pod has free blocks. Counting requests as queued only
    until their first token let them pile up there without limit at 10x load (admitted latency grew for as long
    as the overload lasted); the second token comes from the decode pod's running batch."""
    return event.finished or event.error is not None or event.completion_tokens >= 2


def worker_error(err: dict[str, Any]) -> OpenAIError:
    """A worker's ``OutputEvent.error`` as the client's error (its code, message, param and type)."""
    return OpenAIError(int(err.get("code") or 500), str(err.get("message", "worker error")), err.get("param"),
                       err_type=err.get("type"))


class CompletionService:
    """``create(req, kind, ...)`` serves one completion request end to end; its steps are methods a test can
    call one by one (``plan``, ``submit``, ``events``, ``finish``). ``kind``: "chat" or "completion".
    ``drain``: the shutdown state (requests still running when it expires end with its 503)."""

    def __init__(self, state: RouterState, model: ServedModel, drain: Drain | None = None) -> None:
        self.state = state
        self.settings = state.settings
        self.model = model
        self.drain = drain

    # ---- plan and admission -------------------------------------------------------------------------

    async def plan(self, req: GenerationRequest, span: Any = None) -> RequestPlan:
        """Validate and tokenize: each prompt's token ids and sampling parameters. 400/404 ``OpenAIError``.
        ``span``: the request's root span (the steps are its children)."""
        processor = self.state.processor
        with tracing.span("validate", span):
            self.model.check(req.model)
            check_cross_field(req)
            processor.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        with tracing.span("tokenize", span) as tokenize:
            prompts, prompt_param, tools, structured = await self._tokenize(req)
            tracing.set_attributes(tokenize, {"gen_ai.usage.input_tokens": sum(len(ids) for ids in prompts)})
        max_tokens, max_param = requested_max_tokens(req)
        limit = await self.state.dispatcher.context_limit(processor.max_model_len)
        sampling = []
        for ids in prompts:
            effective = check_context(len(ids), max_tokens, limit, prompt_param, max_param)
            sampling.append(build_sampling_params(req, effective, self.state.defaults,
                                                  getattr(processor, "tokenizer", None), processor.vocab_size,
                                                  structured))
        return RequestPlan(prompts=prompts, sampling=sampling, n=req.n, tools=tools)

    async def _tokenize(self, req: GenerationRequest) -> tuple[list[list[int]], str, Any, Any]:
        """Each prompt's token ids, the parameter that holds the prompt (for errors), the chat's tool plan and the
        structured output its tool choice asks for (None, None for completions)."""
        processor, settings = self.state.processor, self.settings
        tools, structured = None, None
        if isinstance(req, ChatCompletionRequest):
            tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, settings.tool_call_parser,
                              settings.enable_auto_tool_choice)
            schema = guided_schema(req.tools or [], tools)
            structured = ({"json": schema}, "tool_choice") if schema is not None else None
            rendered = [t.model_dump(exclude_none=True) for t in req.tools or []]
            ids = await anyio.to_thread.run_sync(lambda: processor.chat_token_ids(
                req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
                tools=rendered))
            prompts, prompt_param = [ids], "messages"
        else:
            listed = prompt_count(req.prompt)
            if listed > settings.max_prompts_per_request:
                raise errors.bad_request(f"prompt lists {listed} prompts; at most {settings.max_prompts_per_request} "
                                         "are accepted in one request (--max-prompts-per-request)", "prompt")
            prompts = await anyio.to_thread.run_sync(
                lambda: processor.prompt_token_ids(req.prompt, req.add_special_tokens))
            prompt_param = "prompt"
        return prompts, prompt_param, tools, structured

    # ---- submit ------------------------------------------------------------------------------------

    async def submit(self, req: GenerationRequest, kind: str, header_id: str | None = None,
                     api_key_id: str | None = None, traceparent: str | None = None) -> Job:
        """Plan, admit and enqueue every choice of ``req``. ``header_id``: the client's ``X-Request-Id``;
        ``api_key_id``: which API key authenticated it (per-key cache salts); ``traceparent``: the client's W3C
        trace context (the request's root span joins its trace). Errors: ``OpenAIError`` (400, 404, 429, 503),
        ``RedisError``; a request that fails part way has its queued choices aborted."""
        arrival_wall, arrival = time.time(), time.monotonic()
        response_id, client_chose = self.response_id(req, kind, header_id)
        # Every log line of this request names it from here on: this task's and those it starts (a stream's).
        # Each request runs in a task of its own, so the value ends with it. The workers' ids start with it.
        log_request_id.set(response_id)
        span = self.root_span(req, kind, response_id, arrival_wall, traceparent)
        try:
            plan = await self.plan(req, span)
        except BaseException as exc:
            tracing.end(span, error=f"{type(exc).__name__}: {exc}")
            raise
        st = self.state
        with tracing.span("admission", span):
            try:
                st.admission.check([len(ids) for ids in plan.prompts], plan.n)
            except BaseException as exc:
                tracing.end(span, error=f"{type(exc).__name__}: {exc}")
                raise
            job = self.new_job(req, kind, plan, response_id, client_chose, arrival_wall, arrival)
            job.span = span
            st.admission.admit(job.waiting)
            st.jobs.add(job)
        st.metrics.running.inc()
        cache_salt = tenant_cache_salt(req.cache_salt, api_key_id) if self.settings.cache_salt_per_api_key \
            else req.cache_salt
        try:
            for prompt_index in range(len(plan.prompts)):
                await self._dispatch_prompt(job, plan, prompt_index, cache_salt, req.priority, arrival_wall)
        except BaseException:
            # Choices already queued (a batch whose later prompt found no pod) must not run.
            await self.finish(job, aborted=bool(job.pods), reason="enqueue_failed")
            raise
        return job

    def root_span(self, req: GenerationRequest, kind: str, response_id: str, arrival_wall: float,
                  traceparent: str | None) -> Any:
        """The request's root span (GenAI semantic conventions: named ``{operation} {model}``), a child of the
        client's ``traceparent`` when it sent a valid one; None when tracing is off."""
        if not tracing.enabled():
            return None
        operation = "chat" if kind == "chat" else "text_completion"
        max_tokens, _ = requested_max_tokens(req)
        return tracing.start(f"{operation} {self.settings.served_name}", traceparent, {
            "gen_ai.operation.name": operation, "gen_ai.request.model": req.model,
            "gen_ai.request.max_tokens": max_tokens, "gen_ai.request.temperature": req.temperature,
            "gen_ai.request.top_p": req.top_p, "gen_ai.request.choice.count": req.n,
            "gen_ai.response.id": response_id}, start_s=arrival_wall, kind="server")

    @staticmethod
    def response_id(req: GenerationRequest, kind: str, header_id: str | None) -> tuple[str, bool]:
        """The id the client sees (``cmpl-``/``chatcmpl-`` and the client's request id when it sent a valid one,
        else a fresh uuid), and whether the client chose it."""
        client_id = req.request_id or (header_id if header_id and REQUEST_ID_RE.match(header_id) else None)
        return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{client_id or uuid.uuid4().hex}", client_id is not None

    def new_job(self, req: GenerationRequest, kind: str, plan: RequestPlan, response_id: str, client_chose: bool,
                arrival_wall: float, arrival: float) -> Job:
        """The job's internal request ids (``response_id``, or ``response_id-<i>`` per choice, then ``@<router id>``)
        and its builder."""
        total = len(plan.prompts) * plan.n
        # A client may reuse its id (retries): internal ids must stay unique, they name the output streams.
        stem = f"{response_id}-{uuid.uuid4().hex[:8]}" if client_chose else response_id
        # Each id names this router, so its output stream shares the router's Redis Cluster slot (keys.py).
        stems = [stem] if total == 1 else [f"{stem}-{i}" for i in range(total)]
        request_ids = [keys.owned_request_id(s, self.state.router_id) for s in stems]
        builder = self._builder(req, kind, plan, response_id, int(arrival_wall))
        return Job(response_id, request_ids, [], arrival, builder,
                   waiting={i: len(plan.prompts[i // plan.n]) for i in range(total)})

    def _builder(self, req: GenerationRequest, kind: str, plan: RequestPlan, response_id: str,
                 created: int) -> ResponseBuilder:
        processor, settings = self.state.processor, self.settings
        options = req.stream_options
        return ResponseBuilder(kind, response_id, settings.served_name, created, processor.token_str,
                               [len(ids) for ids in plan.prompts], plan.n,
                               bool(req.logprobs) if kind == "chat" else req.logprobs is not None,
                               include_usage=bool(req.stream and options and options.include_usage),
                               continuous_usage=bool(options and options.continuous_usage_stats),
                               prompt_tokens_details=settings.enable_prompt_tokens_details,
                               echo=echo_prefixes(req, plan.prompts, processor.decode), echo_only=echo_only(req),
                               num_logprobs=(req.logprobs or 0) if kind != "chat" else 0,
                               prompt_logprobs=req.prompt_logprobs, token_bytes=processor.token_bytes,
                               tools=plan.tools)

    async def _dispatch_prompt(self, job: Job, plan: RequestPlan, prompt_index: int, cache_salt: str | None,
                               priority: int, arrival_wall: float) -> None:
        """Enqueue the n choices of one prompt and record their routes."""
        ids, n = plan.prompts[prompt_index], plan.n
        first = prompt_index * n
        choices = [ChoiceSpec(job.request_ids[first + j], first + j, plan.choice_params(prompt_index, j),
                              traceparent=tracing.traceparent(job.span)) for j in range(n)]
        with tracing.span("route", job.span) as route:
            sent = await self.state.dispatcher.dispatch(ids, choices, cache_salt=cache_salt, priority=priority,
                                                        arrival_time=arrival_wall)
            if route is not None:
                tracing.set_attributes(route, route_attributes(sent))
        pod, local = sent.placement.pod, sent.placement.local_prefill
        job.pods.extend([pod.pod_id] * n)
        job.routes.extend(ChoiceRoute(c.request_id, pod.pod_id, c.prompt_token_ids, c.sampling_params,
                                      c.cache_salt, c.priority, pod_health_url=health_url(pod),
                                      pod_started_at=getattr(pod, "started_at", None),
                                      queue_stream=sent.stream, queue_entry=entry, remote_prefill=not local)
                          for c, entry in zip(sent.requests, sent.entries))
        self.state.metrics.pd_decisions.labels(self.settings.served_name, "local" if local else "remote",
                                               sent.placement.why or "default").inc(n)
        logger.info("request %s: %d prompt tokens, n=%d -> decode pod %s (%s prefill)", job.response_id,
                    len(ids), n, pod.pod_id, "local" if local else "remote")
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s prompt ids %s params %s", job.response_id, ids, choices[0].sampling_params)

    # ---- bookkeeping -------------------------------------------------------------------------------

    async def finish(self, job: Job, aborted: bool, reason: str = "client_disconnected") -> None:
        """Release the job's bookkeeping; when ``aborted``, tell every worker to drop it (shielded: this
        runs while the request's task is being cancelled). Idempotent."""
        if job.closed:
            return
        job.closed = True
        st = self.state
        self.end_span(job, aborted, reason)
        st.jobs.remove(job)
        with anyio.CancelScope(shield=True):
            st.admission.release(job.waiting)
            st.metrics.running.dec()
            if aborted:
                st.metrics.aborted.labels(self.settings.served_name, reason).inc()
                logger.info("request %s aborted (%s)", job.response_id, reason)
                try:
                    await abort_requests(st.redis, job.request_ids)
                except Exception as exc:
                    logger.error("request %s: abort failed: %s", job.response_id, exc)
            for pod_id in set(job.pods):
                st.dispatcher.finished(pod_id, job.pods.count(pod_id))
            job.pods.clear()

    @staticmethod
    def end_span(job: Job, aborted: bool, reason: str) -> None:
        """End the root span with the response's usage and finish reasons (GenAI conventions)."""
        if job.span is None:
            return
        choices = job.builder.choices
        tracing.end(job.span, {
            "gen_ai.usage.input_tokens": sum(job.builder.prompt_lens),
            "gen_ai.usage.output_tokens": sum(c.completion_tokens for c in choices),
            "gen_ai.response.finish_reasons": [c.finish_reason or "error" for c in choices],
            "pdserve.decode_pods": sorted(set(job.pods))}, error=reason if aborted else None)

    def record_finish(self, job: Job) -> None:
        """Count a completed job's usage and finish reasons (the metrics clients' usage sums to)."""
        metrics = self.state.metrics
        metrics.prompt_tokens.inc(sum(job.builder.prompt_lens))
        metrics.prompt_tokens_cached.inc(job.builder.cached_tokens)
        for c in job.builder.choices:
            metrics.generation_tokens.inc(c.completion_tokens)
            metrics.success.labels(self.settings.served_name, c.finish_reason or "error").inc()

    # ---- output ------------------------------------------------------------------------------------

    def relay(self, job: Job) -> OutputRelay:
        """The job's output relay, with migration and the prefill watch as the settings ask."""
        st, settings = self.state, self.settings

        def migrated(reason: str) -> None:
            st.metrics.migrations.labels(settings.served_name,
                                         "error" if reason.startswith("worker") else "stall").inc()

        migrate = Migrator(st.redis, st.dispatcher, job, settings.max_migrations,
                           settings.migration_pod_gone_wait_s, migrated, http=st.http)
        watch = PrefillWatch(st.redis, st.dispatcher, settings.prefill_stall_s, settings.retry_after_s, http=st.http) \
            if settings.prefill_stall_s else None
        stop = (self.drain.expired, self.drain.error) if self.drain is not None else None
        return OutputRelay(st.redis, job.routes, settings.request_timeout_s, settings.migration_stall_s,
                           migrate if settings.migration_stall_s else None, redis_retry_s=settings.redis_retry_s,
                           stop=stop, watch=watch, reader=st.output_streams)

    async def events(self, job: Job) -> AsyncIterator[tuple[int, OutputEvent]]:
        """``(choice index, event)`` as the workers write them, deduplicated; a worker's error is raised as the
        client's ``OpenAIError``, a Redis outage as 503."""
        timings = [ChoiceTiming(job.arrival) for _ in job.request_ids]
        try:
            async for index, event in self.relay(job):
                if index in job.waiting and started_decoding(event):
                    self.state.admission.dequeue(job.waiting, (index,))
                timings[index].on_event(self.state.metrics, event)
                if event.error is not None:
                    raise worker_error(event.error)
                yield index, event
        except RedisError as exc:
            raise errors.redis_unavailable(exc, self.settings.retry_after_s) from exc

    async def create(self, req: GenerationRequest, kind: str, header_id: str | None = None,
                     api_key_id: str | None = None,
                     is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                     traceparent: str | None = None) -> Response:
        """Serve one request: an SSE stream when ``req.stream``, else the whole JSON body once every choice
        finished (``is_disconnected`` polled meanwhile: a client gone aborts it with 499)."""
        job = await self.submit(req, kind, header_id, api_key_id, traceparent)
        if req.stream:
            return delivery.stream_response(self, job)
        return await delivery.full_response(self, job, is_disconnected)


def route_attributes(sent: Any) -> dict[str, Any]:
    """The route span's attributes: the chosen decode pod, the prefill path and the placement's score."""
    placement = sent.placement
    return {"pdserve.decode_pod": placement.pod.pod_id,
            "pdserve.prefill": "local" if placement.local_prefill else "remote",
            "pdserve.route.reason": placement.why or "default",
            "pdserve.route.cached_blocks": placement.cached_blocks, "pdserve.route.num_blocks": placement.num_blocks,
            **{f"pdserve.route.cost.{k}": float(v) for k, v in placement.costs.items()},
            "pdserve.queue": sent.stream}
