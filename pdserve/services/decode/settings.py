"""The decode worker's settings: the engine workers' (``WorkerSettings``) and its KV-transfer server."""

from __future__ import annotations

from pydantic import Field, model_validator

from pdserve.shared.worker.settings import WorkerSettings

# How much longer a KV reservation (lease) lives than the router's --prefill-stall-s. A prefill worker that stops
# (SIGSTOP, a stuck engine) while it holds a lease here is moved by the router once its queue entry has gone
# untouched for prefill_stall_s, seen at the router's next check (every --migration-stall-s, 2 s) of an entry last
# touched up to 1 s before the stop; the lease must still stand then. Were it to expire first, a worker waking in
# between would send its blocks into no lease and fail the request ("no lease ... expired") instead of it moving.
LEASE_MARGIN_S = 10.0


class DecodeSettings(WorkerSettings):
    port: int = Field(8003, ge=0, le=65535, description="HTTP port for /health and /metrics.")
    kv_port: int = Field(9000, description="KV-transfer TCP port.")
    colocated: bool = Field(False, description="No prefill tier: this pod prefills every request.")
    # The routers' --prefill-stall-s (the same PDSERVE_PREFILL_STALL_S): the lease is ordered after it.
    prefill_stall_s: float = Field(30.0, ge=0, description=(
        "The routers' --prefill-stall-s: a KV reservation outlives it (0 = the routers never move a stalled prefill)."))
    lease_ttl_s: float | None = Field(None, gt=0, description=(
        f"Seconds a KV reservation waits for its transfer (at least --prefill-stall-s + {LEASE_MARGIN_S:g}; "
        f"default: that or 30, the larger)."))
    # how long / how many committed request ids are remembered to refuse a second hand-over of the same one
    handover_memory_s: float = Field(900.0, description=(
        "Seconds a taken-over request id is remembered, so a redelivered queue entry is not decoded twice."))
    handover_memory_max: int = Field(100_000, description="Taken-over request ids remembered at most.")

    @model_validator(mode="after")
    def _lease_outlives_the_stall_check(self) -> DecodeSettings:
        least = lease_floor_s(self.prefill_stall_s)
        if self.lease_ttl_s is None:
            self.lease_ttl_s = max(least, 30.0)
        elif self.lease_ttl_s < least:
            raise ValueError(
                f"--lease-ttl-s {self.lease_ttl_s:g} must be at least --prefill-stall-s {self.prefill_stall_s:g} + "
                f"{LEASE_MARGIN_S:g} = {least:g} s: a prefill worker stopped while it holds a KV reservation would "
                f"fail its request when the lease expires before the router moves the request; raise "
                f"PDSERVE_LEASE_TTL_S or lower PDSERVE_PREFILL_STALL_S (leave the lease unset to derive it)")
        return self


def lease_floor_s(prefill_stall_s: float) -> float:
    """The shortest lease (s) that outlives the routers' prefill stall check; 0 when they never make one."""
    return prefill_stall_s + LEASE_MARGIN_S if prefill_stall_s > 0 else 0.0
