"""The planner's own Prometheus metrics: its estimates, recommendations and decisions, per tier."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .decision import Decision


class PlannerMetrics:
    """One registry per planner (tests create several)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.backlog_tokens = Gauge("pdserve:planner_backlog_tokens",
                                    "Prompt tokens waiting for or in prefill", registry=r)
        self.backlog_entries = Gauge("pdserve:planner_backlog_entries",
                                     "Prefill queue entries waiting or pending", registry=r)
        self.arrival_tokens = Gauge("pdserve:planner_prefill_arrival_tokens_per_second",
                                    "Estimated prompt tokens/s entering the prefill tier", registry=r)
        self.prefill_throughput = Gauge("pdserve:planner_prefill_throughput_per_replica_tokens_per_second",
                                        "Estimated prompt tokens/s one prefill replica sustains", registry=r)
        self.kv_usage = Gauge("pdserve:planner_decode_kv_cache_usage_perc",
                              "Mean KV-cache usage of the decode pods (0..1)", registry=r)
        self.ttft = Gauge("pdserve:planner_ttft_seconds", "Mean TTFT over the last interval", registry=r)
        self.tpot = Gauge("pdserve:planner_tpot_seconds", "Mean TPOT over the last interval", registry=r)
        self.current = Gauge("pdserve:planner_current_replicas", "Observed spec.replicas", ["tier"], registry=r)
        self.recommended = Gauge("pdserve:planner_recommended_replicas",
                                 "Replicas the signals call for, before damping", ["tier"], registry=r)
        self.desired = Gauge("pdserve:planner_desired_replicas", "Replicas decided this round", ["tier"], registry=r)
        self.pending = Gauge("pdserve:planner_pending_pods", "Pods of the tier in phase Pending", ["tier"], registry=r)
        self.decisions = Counter("pdserve:planner_decisions", "Decisions by tier and action",
                                 ["tier", "action"], registry=r)
        self.backoff = Gauge("pdserve:planner_manual_override_backoff",
                             "1 while the planner holds off a tier someone scaled by hand", ["tier"], registry=r)
        self.errors = Counter("pdserve:planner_errors", "Failed steps of a round", ["stage"], registry=r)
        self.rounds = Counter("pdserve:planner_rounds", "Planning rounds run", registry=r)

    def record(self, d: Decision, pending: int, backing_off: bool) -> None:
        self.current.labels(d.tier).set(d.current)
        self.recommended.labels(d.tier).set(d.recommended)
        self.desired.labels(d.tier).set(d.desired)
        self.pending.labels(d.tier).set(pending)
        self.decisions.labels(d.tier, d.action).inc()
        self.backoff.labels(d.tier).set(1 if backing_off else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
