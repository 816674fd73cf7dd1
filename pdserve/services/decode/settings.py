"""The decode worker's settings: the engine workers' (``WorkerSettings``) and its KV-transfer server."""

from __future__ import annotations

from pydantic import Field

from pdserve.shared.worker.settings import WorkerSettings


class DecodeSettings(WorkerSettings):
    port: int = Field(8003, ge=0, le=65535, description="HTTP port for /health and /metrics.")
    kv_port: int = Field(9000, description="KV-transfer TCP port.")
    colocated: bool = Field(False, description="No prefill tier: this pod prefills every request.")
    lease_ttl_s: float = Field(30.0, description="Seconds a KV reservation waits for its transfer.")
    # how long / how many committed request ids are remembered to refuse a second hand-over of the same one
    handover_memory_s: float = Field(900.0, description=(
        "Seconds a taken-over request id is remembered, so a redelivered queue entry is not decoded twice."))
    handover_memory_max: int = Field(100_000, description="Taken-over request ids remembered at most.")
