"""The planner's settings: CLI flags and ``PDSERVE_*`` environment variables, one object (TEAM contract).

The Helm chart sets these from ``autoscaling.*`` and ``planner.*`` values (templates/planner.yaml).
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .decision import TierPolicy


class PlannerSettings(BaseSettings):
    """``--ttft-slo-seconds`` <-> ``PDSERVE_TTFT_SLO_SECONDS`` and so on; ``REDIS_URL`` is accepted as well."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", populate_by_name=True, extra="ignore")

    host: str = "0.0.0.0"
    port: int = Field(8004, ge=0, le=65535)
    log_level: str = "info"
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("PDSERVE_REDIS_URL", "REDIS_URL", "redis_url"),
    )
    # Kubernetes: the namespace and the Deployments to size (the chart passes <release>-pdserve-<tier>).
    namespace: str = Field("default", validation_alias=AliasChoices("PDSERVE_NAMESPACE", "POD_NAMESPACE", "namespace"))
    prefill_deployment: str = "pdserve-prefill"
    decode_deployment: str = "pdserve-decode"
    # Its pods export TTFT/TPOT histograms and the queue gauge; empty = do not scrape a router.
    router_deployment: str = "pdserve-router"
    prefill_metrics_port: int = Field(8002, gt=0, le=65535)
    decode_metrics_port: int = Field(8003, gt=0, le=65535)
    router_metrics_port: int = Field(8000, gt=0, le=65535)
    scrape_timeout_seconds: float = Field(2.0, gt=0)
    interval_seconds: float = Field(15.0, gt=0)
    # Decide and export, but never patch.
    dry_run: bool = False
    # Objectives.
    ttft_slo_seconds: float = Field(2.0, gt=0)
    tpot_slo_seconds: float = Field(0.1, gt=0)
    target_kv_cache_usage: float = Field(0.75, gt=0, le=1)
    # Prompt tokens/s one prefill replica is assumed to sustain until it has been measured under load.
    prefill_throughput_prior: float = Field(2000.0, gt=0)
    # Bounds and damping per tier.
    prefill_min_replicas: int = Field(1, ge=0)
    prefill_max_replicas: int = Field(8, ge=1)
    prefill_scale_up_stabilization_seconds: float = Field(0.0, ge=0)
    prefill_scale_down_stabilization_seconds: float = Field(300.0, ge=0)
    decode_min_replicas: int = Field(1, ge=0)
    decode_max_replicas: int = Field(8, ge=1)
    decode_scale_up_stabilization_seconds: float = Field(0.0, ge=0)
    decode_scale_down_stabilization_seconds: float = Field(600.0, ge=0)
    scale_up_cooldown_seconds: float = Field(60.0, ge=0)
    scale_down_cooldown_seconds: float = Field(120.0, ge=0)
    manual_override_backoff_seconds: float = Field(900.0, ge=0)
    # Relative deviation from the target inside which decode is left alone (HPA's default tolerance).
    tolerance: float = Field(0.1, ge=0, lt=1)

    @model_validator(mode="after")
    def _bounds(self) -> PlannerSettings:
        for tier in ("prefill", "decode"):
            lo, hi = getattr(self, f"{tier}_min_replicas"), getattr(self, f"{tier}_max_replicas")
            if lo > hi:
                raise ValueError(f"{tier}_min_replicas ({lo}) exceeds {tier}_max_replicas ({hi})")
        return self

    def policy(self, tier: str) -> TierPolicy:
        """The damping and bounds of ``tier`` ("prefill" | "decode")."""
        return TierPolicy(
            min_replicas=getattr(self, f"{tier}_min_replicas"),
            max_replicas=getattr(self, f"{tier}_max_replicas"),
            scale_up_stabilization_s=getattr(self, f"{tier}_scale_up_stabilization_seconds"),
            scale_down_stabilization_s=getattr(self, f"{tier}_scale_down_stabilization_seconds"),
            scale_up_cooldown_s=self.scale_up_cooldown_seconds,
            scale_down_cooldown_s=self.scale_down_cooldown_seconds,
            manual_backoff_s=self.manual_override_backoff_seconds,
        )
