"""The prefill worker's settings: the engine workers' (``WorkerSettings``) and its queue and KV hand-over."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve.shared.worker.settings import WorkerSettings


class PrefillSettings(WorkerSettings):
    port: int = Field(8002, ge=0, le=65535, description="HTTP port for /health and /metrics.")
    # queue entries a worker holds at once (prefilling or transferring)
    max_inflight: int = Field(64, description="Queue entries held at once.")
    # an entry idle this long in another consumer's pending list is taken over (that consumer died)
    claim_idle_s: float = Field(60.0, description="Take over entries idle this long (s).")
    # A decode pod with no free KV blocks: the finished prefill waits here (its KV exported, this pod's own blocks
    # freed) in a first-come-first-served line per decode pod until blocks free up -- as vLLM's waiting queue, with
    # no time limit -- or the request's own deadline passes, or (when set) this long has passed; then 503. The client
    # going away ends the wait at once (abort). Keep-alive events (pdserve/shared/worker/keepalive.py) keep the request alive
    # toward the router meanwhile.
    kv_wait_timeout_s: float = Field(0.0, ge=0, description=(
        "Seconds a finished prefill may wait for a full decode pod's KV blocks before 503 (0 = no limit: it waits, "
        "as in vLLM's queue, until blocks free up or the client leaves)."))
    # The longest a decode pod may take to accept and answer the KV-transfer handshake; past it the pod counts as
    # unreachable. A frame unanswered this long fails too, but only once the pod's registry heartbeat has stopped: a
    # live pod busy with long steps is waited for (s).
    kv_transfer_timeout_s: float = Field(20.0, description=(
        "Seconds a decode pod may take to answer the KV handshake, or a frame once its registry heartbeat stopped."))
    # How long routers avoid a decode pod whose KV transfer timed out or broke (unless a transfer to it succeeds
    # again first) (s).
    kv_unreachable_cooldown_s: float = Field(30.0, description=(
        "Seconds routers avoid a decode pod whose KV transfer timed out or broke."))
    # Prefilled KV held here while waiting for decode pods, in bytes: past it no new queue entry is taken (0 = no
    # cap beyond max_inflight).
    max_waiting_kv_bytes: int = Field(4 << 30, description=(
        "Prefilled KV held for decode pods, in bytes, before no new prompt is taken (0 = no cap)."))
    # The token budget per step (prefill chunk), vLLM's name and its CPU `vllm serve` default (2048 per rank); the
    # chart's engine.maxNumBatchedTokens sets the same. A burst of the benchmarks' prompts (16-256 tokens, 136 on
    # average) runs 17 at a time in 3 steps instead of 6 in 9 at 512, for the same prompt tokens per CPU-second
    # (`pdserve bench prefill-budget`, pdserve/loadtest/README.md): prefill-only steps interleave no decodes, so a larger chunk
    # costs no ITL; what it costs is the wait of an abort, a stats call or a new request (one chunk, about 11 CPU-s
    # of the default model in bf16 at 1 thread on a 2-core AVX2 host) and the burst's TTFT p50.
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget per step (the prefill chunk).")

    # The order waiting prompts are prefilled in: srpt = shortest remaining prefill first, aged by
    # srpt_aging_tokens_per_s per second waited (so a short prompt never waits behind a long one that came just
    # before it, and an S-token prompt waits at most (S - 1) / A s longer than under FIFO: docs/routing.md
    # "The prefill queue"); fcfs = arrival order; priority = the request's priority, then arrival.
    scheduling_policy: Literal["srpt", "fcfs", "priority"] = Field("srpt", description=(
        "Order of waiting prompts: srpt (shortest remaining prefill, aged) | fcfs | priority."))
    srpt_aging_tokens_per_s: float = Field(200.0, ge=0, description=(
        "srpt: tokens a waiting prompt's rank drops per second waited (its starvation bound is (S-1)/A s)."))

    # A prefill pod's step has no decodes to protect, so its length is only what a newly queued prompt waits for: a
    # long prompt prefills in chunks of this many tokens, one long prompt at a time, and short prompts queued
    # behind it start at the next chunk instead of after its whole prefill (vLLM's long_prefill_token_threshold and
    # max_long_partial_prefills; measured in `pdserve bench pd-vs-colocated`, pdserve/loadtest/README.md).
    long_prefill_token_threshold: int = Field(256, ge=0, description=(
        "Tokens a prompt prefills per step at most; prompts with more left are long (0: no cap)."))

    def engine_config(self):
        # A prefill pod runs prefill steps only (every request parks after its first token), so decode-batch CUDA
        # graphs would cost start-up time and GPU memory for nothing: always eager here.
        config = super().engine_config()
        config.enforce_eager = True
        config.scheduling_policy = self.scheduling_policy
        config.srpt_aging_tokens_per_s = self.srpt_aging_tokens_per_s
        return config
