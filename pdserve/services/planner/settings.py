"""The planner's settings: CLI flags and ``PDSERVE_*`` environment variables, one object (TEAM contract).

The Helm chart sets these from ``autoscaling.*`` and ``planner.*`` values (templates/planner.yaml).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator

from pdserve.shared.settings import ServiceSettings

from .decision import TierPolicy


class PlannerSettings(ServiceSettings):
    """``--ttft-slo-seconds`` <-> ``PDSERVE_TTFT_SLO_SECONDS`` and so on; ``REDIS_URL`` is accepted as well. Every
    field is a flag of ``pdserve planner`` (``pdserve/shared/settings.py``)."""

    host: str = Field("0.0.0.0", description="Bind address of /health and /metrics.")
    port: int = Field(8004, ge=0, le=65535, description="HTTP port of /health and /metrics.")
    log_level: str = Field("info", description="debug|info|warning|error.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis with the prefill queue.",
                           validation_alias=AliasChoices("PDSERVE_REDIS_URL", "REDIS_URL", "redis_url"))
    # Kubernetes: the namespace and the Deployments to size (the chart passes <release>-pdserve-<tier>).
    namespace: str = Field("default", description="Namespace of the Deployments.",
                           validation_alias=AliasChoices("PDSERVE_NAMESPACE", "POD_NAMESPACE", "namespace"))
    prefill_deployment: str = Field("pdserve-prefill", description="Prefill Deployment to size.")
    decode_deployment: str = Field("pdserve-decode", description="Decode Deployment to size.")
    # What those names are: a Deployment, or a LeaderWorkerSet (the chart's <tier>.multiNode mode: one replica is
    # a leader pod and its tensor-parallel worker pods); both are scaled through their scale subresource.
    prefill_workload_kind: Literal["Deployment", "LeaderWorkerSet"] = Field(
        "Deployment", description="What --prefill-deployment names: Deployment or LeaderWorkerSet.")
    decode_workload_kind: Literal["Deployment", "LeaderWorkerSet"] = Field(
        "Deployment", description="What --decode-deployment names: Deployment or LeaderWorkerSet.")
    # Its pods export TTFT/TPOT histograms and the queue gauge; empty = do not scrape a router.
    router_deployment: str = Field("pdserve-router", description="Router Deployment whose pods export TTFT/TPOT "
                                                                 "('' = none).")
    prefill_metrics_port: int = Field(8002, gt=0, le=65535, description="Metrics port of the prefill pods.")
    decode_metrics_port: int = Field(8003, gt=0, le=65535, description="Metrics port of the decode pods.")
    router_metrics_port: int = Field(8000, gt=0, le=65535, description="Metrics port of the router pods.")
    scrape_timeout_seconds: float = Field(2.0, gt=0, description="Timeout of one pod's metrics scrape (s).")
    interval_seconds: float = Field(15.0, gt=0, description="Seconds between rounds.")
    dry_run: bool = Field(False, description="Decide and export metrics, never patch.")
    # Objectives.
    ttft_slo_seconds: float = Field(2.0, gt=0, description="Time-to-first-token objective (s).")
    tpot_slo_seconds: float = Field(0.1, gt=0, description="Time-per-output-token objective (s).")
    target_kv_cache_usage: float = Field(0.75, gt=0, le=1, description="Decode KV-cache usage to size for (0..1).")
    # Until it has been measured under load.
    prefill_throughput_prior: float = Field(2000.0, gt=0, description=(
        "Prompt tokens/s one prefill replica is assumed to sustain until measured under load."))
    # Bounds and damping per tier.
    prefill_min_replicas: int = Field(1, ge=0, description="Fewest prefill replicas.")
    prefill_max_replicas: int = Field(8, ge=1, description="Most prefill replicas.")
    prefill_scale_up_stabilization_seconds: float = Field(0.0, ge=0, description=(
        "Prefill scales up to the lowest recommendation of this window (s)."))
    prefill_scale_down_stabilization_seconds: float = Field(300.0, ge=0, description=(
        "Prefill scales down to the highest recommendation of this window (s)."))
    decode_min_replicas: int = Field(1, ge=0, description="Fewest decode replicas.")
    decode_max_replicas: int = Field(8, ge=1, description="Most decode replicas.")
    decode_scale_up_stabilization_seconds: float = Field(0.0, ge=0, description=(
        "Decode scales up to the lowest recommendation of this window (s)."))
    decode_scale_down_stabilization_seconds: float = Field(600.0, ge=0, description=(
        "Decode scales down to the highest recommendation of this window (s)."))
    scale_up_cooldown_seconds: float = Field(60.0, ge=0, description=(
        "No second scale-up sooner than this after the last one (s)."))
    scale_down_cooldown_seconds: float = Field(120.0, ge=0, description=(
        "No scale-down sooner than this after any change (s)."))
    manual_override_backoff_seconds: float = Field(900.0, ge=0, description=(
        "After someone else changes a Deployment's replicas, leave it alone this long (s)."))
    # HPA's default tolerance.
    tolerance: float = Field(0.1, ge=0, lt=1, description=(
        "Relative deviation from the target inside which decode is left alone."))

    @model_validator(mode="after")
    def _bounds(self) -> PlannerSettings:
        for tier in ("prefill", "decode"):
            lo, hi = getattr(self, f"{tier}_min_replicas"), getattr(self, f"{tier}_max_replicas")
            if lo > hi:
                raise ValueError(f"{tier}_min_replicas ({lo}) exceeds {tier}_max_replicas ({hi})")
        return self

    def workload_kinds(self) -> dict[str, str]:
        """Workload name -> kind, for ``KubeScaler(kinds=...)``."""
        return {self.prefill_deployment: self.prefill_workload_kind, self.decode_deployment: self.decode_workload_kind}

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
