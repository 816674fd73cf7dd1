"""The router's settings: CLI flags and ``PDSERVE_*`` environment variables, one object, written once."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator

from pdserve.shared.settings import ServiceSettings
from pdserve.shared.settings import load_settings as load

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class RouterSettings(ServiceSettings):
    """``--max-body-bytes`` <-> ``PDSERVE_MAX_BODY_BYTES`` and so on (the flags are generated from these fields:
    ``pdserve/shared/settings.py``); ``REDIS_URL`` is accepted as well."""

    host: str = Field("0.0.0.0", description="Bind address.")
    port: int = Field(8000, description="HTTP port.")
    model: str = Field("smollm2-135m-instruct", description="Model name or local directory.")
    # Name clients send in "model" (vLLM's --served-model-name); defaults to ``model``.
    served_model_name: str | None = Field(None, description="Name clients send as 'model' (default: --model).")
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=AliasChoices("PDSERVE_REDIS_URL", "REDIS_URL"),
                           description="Redis URL.")
    registry_url: str = Field("http://127.0.0.1:8001", description="Block registry URL.")
    # Comma-separated list of accepted keys; unset = no authentication.
    api_key: str | None = Field(None, description="Accepted API key(s), comma-separated.")
    # Each API key gets its own prefix-cache namespace: the salt the engines hash with is derived from the key
    # (and the client's cache_salt, which subdivides it), so tenants holding different keys never share a
    # cached block, whatever cache_salt they send (needs api_key).
    cache_salt_per_api_key: bool = Field(False, description="Give each API key its own prefix-cache namespace.")
    # usage.prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache (vLLM's flag).
    enable_prompt_tokens_details: bool = Field(False, description="Report usage.prompt_tokens_details.cached_tokens.")
    # Bearer token the registry requires (its PDSERVE_REGISTRY_TOKEN); unset = an open registry.
    registry_token: SecretStr | None = Field(None, description="Bearer token the registry requires.")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0, description="Largest request body (413 above).")
    # Default: the model's max_position_embeddings.
    max_model_len: int | None = Field(None, gt=0, description="Context length (default: the model's).")
    # Prompts whose uncached part on the chosen decode pod (kv routing: past the blocks it holds in its pool or
    # its CPU/disk tiers; otherwise the whole prompt) is at most
    # this many tokens are prefilled by that pod itself (0 = never, unless no prefill pod is alive or the
    # decode pod is colocated).
    local_prefill_threshold: int = Field(0, ge=0, description=(
        "Prompts of at most this many tokens are prefilled on the decode pod."))
    # With no prefill pod alive, a decode pod prefills a prompt itself only when at most this many tokens (or
    # local_prefill_threshold) are left to prefill; a longer one waits in the prefill queue (a long prefill in a
    # decode batch stalls every request decoding there) and gets 503 after prefill_stall_s if no prefill pod comes.
    local_prefill_fallback_max_tokens: int = Field(256, ge=0, description=(
        "With no prefill pod alive, only prompts of at most this many tokens go to a decode pod's local prefill; "
        "longer ones wait for a prefill pod."))
    # The local-or-remote prefill decision above the threshold (pd_policy.py; docs/routing.md "How it works",
    # step 6): queue-aware (estimated TTFT each way, the TPOT of the decode pod's running requests against the SLO) or
    # threshold (remote above the threshold).
    pd_policy: Literal["queue-aware", "threshold"] = Field("queue-aware", description=(
        "Local-or-remote prefill decision: queue-aware | threshold."))
    # queue-aware: remote while its estimated TTFT meets this (ms, 0 = none: the lower estimate wins).
    ttft_slo_ms: float = Field(2000.0, ge=0, description="queue-aware: TTFT SLO (ms, 0 = none).")
    # queue-aware: no local prefill that would make a step of a busy decode pod longer than this (ms, 0 = none).
    tpot_slo_ms: float = Field(100.0, ge=0, description="queue-aware: TPOT SLO of running requests (ms, 0 = none).")
    # queue-aware: prompt tokens one pod prefills per second (an estimate of the hardware; the estimates' unit).
    prefill_tokens_per_s: float = Field(1000.0, gt=0, description=(
        "queue-aware: prompt tokens/s one pod prefills (estimate)."))
    # queue-aware: the decode pods' token budget per step (their own --max-num-batched-tokens; the same variable).
    max_num_batched_tokens: int = Field(2048, ge=1, description=(
        "queue-aware: the decode pods' token budget per step (their --max-num-batched-tokens)."))
    # A queued request whose prefill worker has not touched its entry for this long (the worker is stopped or its
    # engine is stuck; a live one touches its entries every second), or whose entry Redis lost, moves to another
    # pod under a new id (counted by max_migrations); one that no prefill pod took for this long while none was
    # alive gets 503 (s, 0 = never; checked every migration_stall_s).
    prefill_stall_s: float = Field(30.0, ge=0, description=(
        "Move a request whose prefill worker stopped touching it (or whose queue entry Redis lost) after this "
        "long (0 = never)."))
    # Decode pod choice: kv (prefix overlap + load, one registry lookup per request), least_loaded, round_robin.
    routing_mode: Literal["kv", "round_robin", "least_loaded"] = Field("kv", description="Decode pod choice.")
    # kv: cost = uncached prompt blocks + routing_load_weight x requests on the pod (blocks per request).
    routing_load_weight: float = Field(8.0, ge=0, description=(
        "kv routing: cost of one request on a pod, in prompt blocks."))
    # kv: softmax temperature over costs, in blocks (0 = always the cheapest, ties at random).
    routing_temperature: float = Field(1.0, ge=0, description=(
        "kv routing: softmax temperature over costs, in blocks (0 = cheapest)."))
    # kv: a prompt block a pod holds in its CPU / disk offloading tier counts this much of one in its KV pool (a
    # load back is cheaper than a prefill but not free); device > CPU > disk > none (docs/routing.md).
    routing_kv_cpu_weight: float = Field(0.9, ge=0, le=1, description=(
        "kv routing: worth of a prompt block in a pod's CPU offloading tier, against one in its KV pool (0..1)."))
    routing_kv_disk_weight: float = Field(0.7, ge=0, le=1, description=(
        "kv routing: worth of a prompt block in a pod's disk offloading tier, against one in its KV pool (0..1)."))
    # How long a pod list from the registry is reused (s).
    registry_cache_s: float = Field(0.5, ge=0, description="How long a pod list from the registry is reused (s).")
    # A request that sees no output event for this long is aborted with 504 (s).
    request_timeout_s: float = Field(600.0, gt=0, description="Abort after this long without output (s, 504).")
    # The workers' keep-alive interval (their --output-keepalive-s, the same PDSERVE_OUTPUT_KEEPALIVE_S): a waiting
    # request is silent for up to 1.5x it, so request_timeout_s below twice it would end requests that are well.
    output_keepalive_s: float = Field(5.0, gt=0, description=(
        "The workers' keep-alive interval (s); --request-timeout-s must be at least twice it."))
    # A choice with no output event for this long is checked: if its decode pod left the registry (heartbeats
    # stopped), it is re-enqueued to another pod with the tokens already sent (0 = never migrate).
    migration_stall_s: float = Field(2.0, ge=0, description=(
        "Move a stalled choice off a decode pod that left the registry after this long (0 = never)."))
    # How often one choice may be moved to another decode pod before it fails with 503.
    max_migrations: int = Field(3, ge=0, description="Moves per choice before it fails with 503.")
    # A worker's 503 (decode pod unreachable) migrates once the pod has left the registry within this long (s).
    migration_pod_gone_wait_s: float = Field(10.0, ge=0, description=(
        "A worker's 503 (decode pod unreachable) migrates once the pod has left the registry within this long "
        "(s)."))
    # Admission control: choices (prompts x n) not decoding yet (queued, prefilling, or waiting for a decode
    # slot after their first token: RouterState.queued), and their prompt tokens; one more gets 429 with
    # Retry-After (0 = no limit).
    max_queued_requests: int = Field(0, ge=0, description=(
        "Requests (each prompt x n counts) not decoding yet (queued, prefilling, or waiting for their second "
        "token); more get 429 (0 = no limit)."))
    max_queued_prompt_tokens: int = Field(0, ge=0, description=(
        "Prompt tokens of the requests not decoding yet; more get 429 (0 = no limit)."))
    # Connections to Redis this router opens at most: each request in flight holds one while it waits for
    # output (a blocking XREAD); past the limit commands wait for a free one. Keep it below Redis's maxclients
    # (10,000 by default) divided by the number of routers.
    redis_max_connections: int = Field(1024, gt=0, description=(
        "Redis connections this router opens at most (keep below Redis's maxclients / routers)."))
    # How long a request's output reader keeps retrying while Redis is unreachable (a restart) before 503 (s).
    redis_retry_s: float = Field(30.0, ge=0, description=(
        "How long a request's output reader retries while Redis is unreachable before 503 (s)."))
    # Requests this router serves at once; one more gets 429 with Retry-After (0 = no limit).
    max_concurrent_requests: int = Field(0, ge=0, description="Requests served at once; more get 429 (0 = no limit).")
    # On SIGTERM: how long requests in flight may still run (new ones get 503) before the rest end with an
    # error chunk (s). Kubernetes' terminationGracePeriodSeconds must exceed it plus the preStop pause.
    shutdown_grace_s: float = Field(30.0, ge=0, description=(
        "On SIGTERM, seconds requests in flight may still run before they end with an error."))
    # Retry-After (s) sent with 503 when no decode pod is alive, and with 429.
    retry_after_s: int = Field(1, ge=0, description=(
        "Retry-After (s) sent with 429, and with 503 when no decode pod is alive."))
    # SSE keep-alive comments (": ping - <time>") every this many seconds on a stream; 0 = none (default, as vLLM:
    # clients such as vLLM's benchmark json-decode every non-empty line and fail on a comment). Opt in only for
    # a proxy that cuts idle connections while a long prompt is prefilled.
    sse_ping_s: float = Field(0.0, ge=0, description=(
        "SSE keep-alive comments every this many seconds (0 = none: only data lines)."))
    # Prompts one /v1/completions request may list; more get 400 naming "prompt". Each prompt x n is one choice,
    # and every choice counts against --max-queued-requests.
    max_prompts_per_request: int = Field(256, gt=0, description=(
        "Prompts one /v1/completions request may list; more get 400."))
    # HTTP guards against clients that hold connections open without finishing a request (slowloris): a request
    # head (request line and headers) must arrive within http_header_timeout_s of the connection opening or of
    # the previous response, a request body within http_body_timeout_s of its head (408 otherwise); an idle
    # keep-alive connection is closed after http_keep_alive_s.
    http_header_timeout_s: float = Field(10.0, gt=0, description=(
        "A request head must arrive within this long, else 408 and close (s)."))
    http_body_timeout_s: float = Field(60.0, gt=0, description=(
        "A request body must arrive within this long of its head, else 408 (s)."))
    http_keep_alive_s: float = Field(5.0, gt=0, description=(
        "Close an idle keep-alive connection after this long (s)."))
    # A Jinja chat template used instead of the model's (vLLM's --chat-template): a file, e.g. one with tool
    # support (pdserve/services/router/templates/hermes_tools.jinja).
    chat_template: str | None = Field(None, description="Chat template file used instead of the model's own.")
    # How tool calls are read out of the model's text (tool_parsers.py), and whether tool_choice "auto" (the
    # default with tools) is served: both needed for it, as in vLLM.
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(None, description=(
        "Tool-call format in the model's text: hermes | llama3_json."))
    enable_auto_tool_choice: bool = Field(False, description=(
        'Serve tool_choice "auto" (needs --tool-call-parser).'))
    # /v1/responses with store (the default): how long a stored response stays in Redis for GET and
    # previous_response_id (s).
    responses_ttl_s: int = Field(86400, gt=0, description="How long a stored /v1/responses response is kept (s).")
    log_level: str = Field("info", description="debug|info|warning|error.")

    @model_validator(mode="after")
    def _timeout_covers_keepalives(self) -> RouterSettings:
        error = keepalive_bound_error(self.request_timeout_s, self.output_keepalive_s)
        if error is not None:
            raise ValueError(error)
        return self

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def api_keys(self) -> list[str]:
        if not self.api_key:
            return []
        return [k.strip() for k in self.api_key.split(",") if k.strip()]


def keepalive_bound_error(request_timeout_s: float, output_keepalive_s: float) -> str | None:
    """Why a silence bound is too short for the workers' keep-alives (one line), or None. A worker writes a
    keep-alive for a request silent ``output_keepalive_s`` every half of it, so a well request is silent for up to 1.5x
    the interval plus delivery; the bound must be at least twice the interval."""
    if request_timeout_s >= 2 * output_keepalive_s:
        return None
    return (f"--request-timeout-s {request_timeout_s:g} is less than twice the workers' keep-alive interval "
            f"(--output-keepalive-s {output_keepalive_s:g}): requests that only wait would end with 504; raise the "
            f"timeout to at least {2 * output_keepalive_s:g} s or lower PDSERVE_OUTPUT_KEEPALIVE_S")


def load_settings(**flags) -> RouterSettings:
    """``RouterSettings(**flags)`` (and ``PDSERVE_*``); raises ``click.ClickException`` with one line per bad field."""
    return load(RouterSettings, **flags)
