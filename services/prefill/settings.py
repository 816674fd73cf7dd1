"""The prefill worker's settings: the engine workers' (``WorkerSettings``) and its queue and KV hand-over."""

from __future__ import annotations

from pydantic import Field

from pdserve.shared.worker.settings import WorkerSettings


class PrefillSettings(WorkerSettings):
    port: int = Field(8002, ge=0, le=65535, description="HTTP port for /health and /metrics.")
    # queue entries a worker holds at once (prefilling or transferring)
    max_inflight: int = Field(64, description="Queue entries held at once.")
    # an entry idle this long in another consumer's pending list is taken over (that consumer died)
    claim_idle_s: float = Field(60.0, description="Take over entries idle this long (s).")
    # A decode pod with no free KV blocks: the finished prefill waits here (its KV exported, this pod's own blocks
    # freed) in a first-come-first-served line per decode pod for up to this long, then fails with 503 (s; keep it
    # below the router's --request-timeout-s, which ends a request silent for that long).
    kv_wait_timeout_s: float = Field(480.0, description=(
        "Seconds a finished prefill waits for a full decode pod's KV blocks before 503."))
    # The longest a decode pod may take to accept and answer the KV-transfer handshake, or to answer any frame;
    # past it the pod counts as unreachable (s).
    kv_transfer_timeout_s: float = Field(20.0, description=(
        "Seconds a decode pod may take to answer the KV handshake or a frame."))
    # How long routers avoid a decode pod whose KV transfer timed out or broke (unless a transfer to it succeeds
    # again first) (s).
    kv_unreachable_cooldown_s: float = Field(30.0, description=(
        "Seconds routers avoid a decode pod whose KV transfer timed out or broke."))
    # Prefilled KV held here while waiting for decode pods, in bytes: past it no new queue entry is taken (0 = no
    # cap beyond max_inflight).
    max_waiting_kv_bytes: int = Field(4 << 30, description=(
        "Prefilled KV held for decode pods, in bytes, before no new prompt is taken (0 = no cap)."))
    # The token budget per step (prefill chunk): an abort, a stats call or a new request waits at most one step,
    # so a long prompt is prefilled in chunks of this size rather than in one step of minutes on a busy CPU.
    max_num_batched_tokens: int = Field(512, ge=1, description="Token budget per step (the prefill chunk).")
