"""The registry's Prometheus metrics (``pdserve:registry_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RegistryMetrics:
    """The registry's Prometheus metrics (one registry per app, so several registries live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.heartbeats = Counter("pdserve:registry_heartbeats_total", "Heartbeats received", ["role"], registry=r)
        self.deregistrations = Counter("pdserve:registry_deregistrations_total", "Pods deregistered", registry=r)
        self.redis_errors = Counter("pdserve:registry_redis_errors_total", "Requests failed on Redis", registry=r)
        # 1 when the last /metrics scrape reached Redis, else 0 (the PdserveRedisUnreachable alert, docs/runbooks.md)
        self.redis_up = Gauge("pdserve:redis_up", "1 if Redis answered at the last scrape, else 0", registry=r)
        self.pods = Gauge("pdserve:registry_pods", "Alive pods (at scrape time)", ["role"], registry=r)
        self.kv_events = Counter("pdserve:registry_kv_events_total", "Block events applied", registry=r)
        self.kv_resyncs = Counter("pdserve:registry_kv_resyncs_total",
                                  "Resyncs asked of pods (sequence gap, unknown pod or epoch)", registry=r)
        self.kv_snapshots = Counter("pdserve:registry_kv_snapshots_total", "Snapshots applied", registry=r)
        self.kv_lookups = Counter("pdserve:registry_kv_lookups_total", "Prefix lookups answered", registry=r)
        self.kv_blocks = Gauge("pdserve:registry_kv_blocks", "Blocks indexed per alive pod (at scrape time)",
                               ["pod", "role"], registry=r)
        self.free_blocks = Gauge("pdserve:registry_free_blocks", "Free KV blocks reported by alive pods",
                                 ["role"], registry=r)
        self.auth_failures = Counter("pdserve:registry_auth_failures_total",
                                     "Requests refused with 401 (reason: missing_token, invalid_token)", ["reason"],
                                     registry=r)
