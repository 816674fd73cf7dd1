"""Prometheus metrics of an engine worker, named as vLLM's with a ``pdserve:`` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# engine stat -> counter name (the engine keeps totals; counters advance by the difference)
_COUNTERS = {
    "prompt_tokens_computed": ("pdserve:prompt_tokens", "Prompt tokens run through the model"),
    "generation_tokens": ("pdserve:generation_tokens", "Generated tokens"),
    "prefix_cache_queries": ("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "num_preemptions": ("pdserve:num_preemptions", "Preemptions"),
}


class WorkerMetrics:
    def __init__(self, role: str, pod_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "pod": pod_id}
        self.labels = labels
        r = self.registry
        names = list(labels)
        self.running = Gauge("pdserve:num_requests_running", "Requests in the running batch", names, registry=r).labels(**labels)
        self.waiting = Gauge("pdserve:num_requests_waiting", "Requests waiting for the engine", names, registry=r).labels(**labels)
        self.kv_usage = Gauge("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)", names, registry=r).labels(**labels)
        self.kv_blocks_used = Gauge("pdserve:kv_blocks_used", "KV blocks held by requests", names, registry=r).labels(**labels)
        self.counters = {
            key: Counter(name, doc, names, registry=r).labels(**labels) for key, (name, doc) in _COUNTERS.items()
        }
        self._last = {key: 0 for key in _COUNTERS}
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Arrival to first token", names,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Time between output events", names,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Arrival to last token", names,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.queue_time = Histogram("pdserve:request_queue_time_seconds", "Arrival to being taken from the queue",
                                    names, buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.prefill_time = Histogram("pdserve:request_prefill_time_seconds", "Taken from the queue to first token",
                                      names, buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.first_decode_step = Histogram("pdserve:first_decode_step_seconds",
                                           "KV hand-over committed to the decode pod's first token", names,
                                           buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.kv_transfer_bytes = Counter("pdserve:kv_transfer_bytes", "KV bytes sent or received", names, registry=r).labels(**labels)
        self.kv_transfer_seconds = Histogram("pdserve:kv_transfer_seconds", "Time to transfer one request's KV", names,
                                             buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.kv_transfer_blocks = Counter("pdserve:kv_transfer_blocks", "KV blocks sent or received", names, registry=r).labels(**labels)
        self.kv_transfer_blocks_skipped = Counter("pdserve:kv_transfer_blocks_skipped",
                                                  "KV blocks not sent because the decode pod held them", names,
                                                  registry=r).labels(**labels)
        self.queue_depth = Gauge("pdserve:prefill_queue_depth", "Messages in the prefill queue", names, registry=r).labels(**labels)
        self.queue_tokens = Gauge("pdserve:prefill_queue_tokens", "Prompt tokens taken from the queue, not yet prefilled",
                                  names, registry=r).labels(**labels)
        self.requests_failed = Counter("pdserve:request_failures", "Requests that ended with an error", names, registry=r).labels(**labels)
        self.requests_orphaned = Counter("pdserve:requests_orphaned", "Requests dropped because the router relaying "
                                         "them is gone", names, registry=r).labels(**labels)

    def update_from_stats(self, stats: dict) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.kv_blocks_used.set(stats["kv_blocks_used"])
        for key, counter in self.counters.items():
            delta = stats[key] - self._last[key]
            if delta > 0:
                counter.inc(delta)
            self._last[key] = stats[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)
