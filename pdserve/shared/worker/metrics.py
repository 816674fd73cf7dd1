"""Prometheus metrics of an engine worker, named as vLLM's with a ``pdserve:`` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# engine stat -> counter name (the engine keeps totals; counters advance by the difference). Each name means one
# thing on every pod, so a sum over pods is an ensemble total; the router's client-side counters
# (``pdserve:prompt_tokens``, ``pdserve:generation_tokens``, ``pdserve:prompt_tokens_cached``) are not
# repeated here (issue 17.3; docs/metrics.md "Counters").
_COUNTERS = {
    "prompt_tokens_computed": ("pdserve:prompt_tokens_computed",
                               "Prompt tokens run through the model (not prefix-cache hits, not recompute)"),
    "prompt_tokens_recomputed": ("pdserve:prompt_tokens_recomputed",
                                 "Tokens run through the model again after a recompute preemption"),
    "sampled_tokens": ("pdserve:sampled_tokens",
                       "Tokens this pod sampled (prefill pod: each request's first; decode pod: the rest)"),
    "prefix_cache_queries": ("pdserve:prefix_cache_queries",
                             "Prompt tokens of new requests looked up in the prefix cache before computing"),
    "prefix_cache_hits": ("pdserve:prefix_cache_hits", "Of those, tokens found cached (not computed)"),
    "prefix_cache_preempted_queries": ("pdserve:prefix_cache_preempted_queries",
                                       "Tokens of recompute-preempted requests looked up again on resume"),
    "prefix_cache_preempted_hits": ("pdserve:prefix_cache_preempted_hits",
                                    "Of those, tokens found again (recompute saved)"),
    "prefix_cache_transfer_queries": ("pdserve:kv_transfer_prefix_cache_queries",
                                      "Prompt tokens of KV reservations looked up in this decode pod's cache"),
    "prefix_cache_transfer_hits": ("pdserve:kv_transfer_prefix_cache_hits",
                                   "Of those, tokens already here (their KV was not sent)"),
    "num_preemptions": ("pdserve:num_preemptions", "Preemptions"),
    "kv_blocks_swapped_out": ("pdserve:kv_blocks_swapped_out", "KV blocks copied to the CPU swap pool"),
    "kv_blocks_swapped_in": ("pdserve:kv_blocks_swapped_in", "KV blocks copied back from the CPU swap pool"),
    # speculative decoding (vLLM's names; 0 without a speculative_config)
    "spec_decode_num_drafts": ("pdserve:spec_decode_num_drafts", "Verification steps of requests with draft tokens"),
    "spec_decode_num_draft_tokens": ("pdserve:spec_decode_num_draft_tokens", "Draft tokens proposed and verified"),
    "spec_decode_num_accepted_tokens": ("pdserve:spec_decode_num_accepted_tokens", "Draft tokens accepted"),
}
# offloading tiers (pdserve/shared/engine/kv_offload.py): engine stat ``kv_offload_<tier>_<key>`` -> a counter or
# gauge with a ``tier`` label (``cpu``, ``disk``); absent stats (no tiers) leave them at 0
_OFFLOAD_COUNTERS = {
    "hit_tokens": "Prompt tokens whose KV was loaded back from this tier (part of prefix_cache_hits)",
    "bytes_written": "KV bytes written to this tier",
    "bytes_loaded": "KV bytes loaded back from this tier into the pool",
    "blocks_loaded": "KV blocks loaded back from this tier",
    "load_seconds": "Time spent loading blocks back from this tier (s; divide by blocks_loaded for the mean)",
    "evictions": "KV blocks pushed out of this tier (CPU: on to disk, if any; disk: dropped)",
    "bad_files": "Torn, corrupted or foreign block files skipped (never loaded)",
    "writes_refused": "Block writes the tier refused (disk full, I/O error); serving went on without them",
}
_OFFLOAD_GAUGES = {"blocks_used": "KV blocks this tier holds", "blocks_total": "KV blocks this tier can hold"}

# engine stats that are derived: a queries/hits counter above counts only new requests' lookups
_DERIVED = {
    "prefix_cache_queries": lambda s: s["prefix_cache_queries"] - s.get("prefix_cache_transfer_queries", 0),
    "prefix_cache_hits": lambda s: s["prefix_cache_hits"] - s.get("prefix_cache_transfer_hits", 0),
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
        # preemption by swap made visible (issue 12.B): vLLM v0's names, plus the pool in blocks
        self.swapped = Gauge("pdserve:num_requests_swapped", "Requests whose KV is in the CPU swap pool", names,
                             registry=r).labels(**labels)
        self.cpu_usage = Gauge("pdserve:cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (0..1)", names,
                               registry=r).labels(**labels)
        self.cpu_blocks_used = Gauge("pdserve:cpu_swap_blocks_used", "CPU swap blocks holding a preempted request's KV",
                                     names, registry=r).labels(**labels)
        self.cpu_blocks_total = Gauge("pdserve:cpu_swap_blocks_total", "CPU swap blocks (0: recompute preemption)",
                                      names, registry=r).labels(**labels)
        # vLLM's cache_config_info: value 1, the configuration in labels
        self.cache_config = Gauge("pdserve:cache_config_info", "KV cache configuration (labels; value 1)",
                                  names + ["preemption_mode", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                                           "enable_prefix_caching"], registry=r)
        self._config_labels: dict | None = None
        self.counters = {
            key: Counter(name, doc, names, registry=r).labels(**labels) for key, (name, doc) in _COUNTERS.items()
        }
        self._last = {key: 0 for key in _COUNTERS}
        self.spec_per_pos = Counter("pdserve:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft (0 first)", names + ["position"],
                                    registry=r)
        self._last_per_pos: list[int] = []
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
        # sent on a prefill pod, received on a decode pod: two names, so a sum over pods counts each block once
        way = "sent" if role == "prefill" else "received"
        self.kv_transfer_bytes = Counter(f"pdserve:kv_transfer_{way}_bytes", f"KV bytes {way}", names,
                                         registry=r).labels(**labels)
        self.kv_transfer_seconds = Histogram("pdserve:kv_transfer_seconds", "Time to transfer one request's KV", names,
                                             buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.kv_transfer_blocks = Counter(f"pdserve:kv_transfer_{way}_blocks", f"KV blocks {way}", names,
                                          registry=r).labels(**labels)
        self.kv_transfer_blocks_skipped = Counter("pdserve:kv_transfer_blocks_skipped",
                                                  "KV blocks not sent because the decode pod held them", names,
                                                  registry=r).labels(**labels)
        self.queue_depth = Gauge("pdserve:prefill_queue_depth", "Messages in the prefill queue", names, registry=r).labels(**labels)
        self.queue_tokens = Gauge("pdserve:prefill_queue_tokens", "Prompt tokens taken from the queue, not yet prefilled",
                                  names, registry=r).labels(**labels)
        self.offload_counters = {
            key: Counter(f"pdserve:kv_offload_{key}", doc, names + ["tier"], registry=r) for key, doc in _OFFLOAD_COUNTERS.items()
        }
        self.offload_gauges = {
            key: Gauge(f"pdserve:kv_offload_{key}", doc, names + ["tier"], registry=r) for key, doc in _OFFLOAD_GAUGES.items()
        }
        self._last_offload: dict[str, float] = {}
        self.requests_failed = Counter("pdserve:request_failures", "Requests that ended with an error", names, registry=r).labels(**labels)
        self.requests_orphaned = Counter("pdserve:requests_orphaned", "Requests dropped because the router relaying "
                                         "them is gone", names, registry=r).labels(**labels)

    def update_from_stats(self, stats: dict) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.kv_blocks_used.set(stats["kv_blocks_used"])
        cpu_total = stats.get("cpu_swap_blocks_total", 0)
        self.swapped.set(stats.get("num_requests_swapped", 0))
        self.cpu_blocks_used.set(stats.get("cpu_swap_blocks_used", 0))
        self.cpu_blocks_total.set(cpu_total)
        self.cpu_usage.set(stats.get("cpu_swap_blocks_used", 0) / cpu_total if cpu_total else 0.0)
        if self._config_labels is None and "preemption_mode" in stats:
            self._config_labels = {**self.labels, "preemption_mode": stats["preemption_mode"],
                                   "block_size": str(stats.get("block_size", "")),
                                   "num_gpu_blocks": str(stats.get("kv_blocks_total", "")),
                                   "num_cpu_blocks": str(cpu_total),
                                   "enable_prefix_caching": str(stats.get("enable_prefix_caching", "")).lower()}
            self.cache_config.labels(**self._config_labels).set(1)
        for key, counter in self.counters.items():
            value = _DERIVED[key](stats) if key in _DERIVED else stats.get(key, 0)
            delta = value - self._last[key]
            if delta > 0:
                counter.inc(delta)
            self._last[key] = value
        self._update_offload(stats)
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos", ())
        for pos, value in enumerate(per_pos):
            last = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
            if value > last:
                self.spec_per_pos.labels(**self.labels, position=str(pos)).inc(value - last)
        self._last_per_pos = list(per_pos)

    def _update_offload(self, stats: dict) -> None:
        if "kv_offload_cpu_blocks_total" not in stats:
            return
        for tier in ("cpu", "disk"):
            for key, gauge in self.offload_gauges.items():
                gauge.labels(**self.labels, tier=tier).set(stats[f"kv_offload_{tier}_{key}"])
            for key, counter in self.offload_counters.items():
                name = f"kv_offload_{tier}_{key}"
                delta = stats[name] - self._last_offload.get(name, 0)
                child = counter.labels(**self.labels, tier=tier)  # shown at 0 from the first update
                if delta > 0:
                    child.inc(delta)
                self._last_offload[name] = stats[name]

    def render(self) -> bytes:
        return generate_latest(self.registry)
