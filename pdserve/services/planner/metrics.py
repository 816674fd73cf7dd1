"""The planner's own Prometheus metrics: its estimates, recommendations and decisions, per tier."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.shared.metric_table import Metric, build

from .decision import Decision


_TIER = ("tier",)
METRICS = (
    Metric("backlog_tokens", "gauge", "pdserve:planner_backlog_tokens", "Prompt tokens waiting for or in prefill"),
    Metric("backlog_entries", "gauge", "pdserve:planner_backlog_entries", "Prefill queue entries waiting or pending"),
    Metric("arrival_tokens", "gauge", "pdserve:planner_prefill_arrival_tokens_per_second",
           "Estimated prompt tokens/s entering the prefill tier"),
    Metric("prefill_throughput", "gauge", "pdserve:planner_prefill_throughput_per_replica_tokens_per_second",
           "Estimated prompt tokens/s one prefill replica sustains"),
    Metric("kv_usage", "gauge", "pdserve:planner_decode_kv_cache_usage_perc",
           "Mean KV-cache usage of the decode pods (0..1)"),
    Metric("ttft", "gauge", "pdserve:planner_ttft_seconds", "Mean TTFT over the last interval"),
    Metric("tpot", "gauge", "pdserve:planner_tpot_seconds", "Mean TPOT over the last interval"),
    Metric("current", "gauge", "pdserve:planner_current_replicas", "Observed spec.replicas", _TIER),
    Metric("recommended", "gauge", "pdserve:planner_recommended_replicas",
           "Replicas the signals call for, before damping", _TIER),
    Metric("desired", "gauge", "pdserve:planner_desired_replicas", "Replicas decided this round", _TIER),
    Metric("pending", "gauge", "pdserve:planner_pending_pods", "Pods of the tier in phase Pending", _TIER),
    Metric("decisions", "counter", "pdserve:planner_decisions", "Decisions by tier and action", ("tier", "action")),
    Metric("backoff", "gauge", "pdserve:planner_manual_override_backoff",
           "1 while the planner holds off a tier someone scaled by hand", _TIER),
    Metric("errors", "counter", "pdserve:planner_errors", "Failed steps of a round", ("stage",)),
    Metric("rounds", "counter", "pdserve:planner_rounds", "Planning rounds run"),
)
BASE_LABELS: tuple[str, ...] = ()


class PlannerMetrics:
    """The planner's metrics (``METRICS``), each an attribute by its row's ``attr``; one registry per planner
    (tests create several)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        for attr, metric in build(METRICS, r).items():
            setattr(self, attr, metric)

    def record(self, d: Decision, pending: int, backing_off: bool) -> None:
        self.current.labels(d.tier).set(d.current)
        self.recommended.labels(d.tier).set(d.recommended)
        self.desired.labels(d.tier).set(d.desired)
        self.pending.labels(d.tier).set(pending)
        self.decisions.labels(d.tier, d.action).inc()
        self.backoff.labels(d.tier).set(1 if backing_off else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
