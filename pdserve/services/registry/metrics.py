"""The registry's Prometheus metrics (``pdserve:registry_*``), declared in one table (``METRICS``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.shared.metric_table import Metric, build

METRICS = (
    Metric("heartbeats", "counter", "pdserve:registry_heartbeats_total", "Heartbeats received", ("role",)),
    Metric("deregistrations", "counter", "pdserve:registry_deregistrations_total", "Pods deregistered"),
    Metric("redis_errors", "counter", "pdserve:registry_redis_errors_total", "Requests failed on Redis"),
    # 1 when the last /metrics scrape reached Redis, else 0 (the PdserveRedisUnreachable alert, docs/runbooks.md)
    Metric("redis_up", "gauge", "pdserve:redis_up", "1 if Redis answered at the last scrape, else 0"),
    Metric("pods", "gauge", "pdserve:registry_pods", "Alive pods (at scrape time)", ("role",)),
    Metric("kv_events", "counter", "pdserve:registry_kv_events_total", "Block events applied"),
    Metric("kv_resyncs", "counter", "pdserve:registry_kv_resyncs_total",
           "Resyncs asked of pods (sequence gap, unknown pod or epoch)"),
    Metric("kv_snapshots", "counter", "pdserve:registry_kv_snapshots_total", "Snapshots applied"),
    Metric("kv_lookups", "counter", "pdserve:registry_kv_lookups_total", "Prefix lookups answered"),
    # what a router's 2 s registry timeout is measured against: the lookup's cost grows with the alive pods
    Metric("kv_lookup_seconds", "histogram", "pdserve:registry_kv_lookup_seconds",
           "Time to answer a prefix lookup (pods listed, every pod's overlap walked)",
           buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)),
    Metric("kv_blocks", "gauge", "pdserve:registry_kv_blocks", "Blocks indexed per alive pod (at scrape time)",
           ("pod", "role")),
    Metric("free_blocks", "gauge", "pdserve:registry_free_blocks", "Free KV blocks reported by alive pods", ("role",)),
    Metric("auth_failures", "counter", "pdserve:registry_auth_failures_total",
           "Requests refused with 401 (reason: missing_token, invalid_token)", ("reason",)),
)
BASE_LABELS: tuple[str, ...] = ()


class RegistryMetrics:
    """The registry's metrics (``METRICS``), each an attribute by its row's ``attr``; one registry per app, so
    several registries live in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for attr, metric in build(METRICS, self.registry).items():
            setattr(self, attr, metric)
