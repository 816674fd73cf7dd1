"""Prometheus metrics of an engine worker, named as vLLM's with a ``pdserve:`` prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.shared.metric_table import Metric, build

if TYPE_CHECKING:  # the stats type only: this module stays importable without torch (pdserve top, tests)
    from pdserve.shared.engine.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# Counters follow an engine total (``stat``; they advance by the difference). Each name means one thing on every
# pod, so a sum over pods is an ensemble total; the router's client-side counters (``pdserve:prompt_tokens``,
# ``pdserve:generation_tokens``, ``pdserve:prompt_tokens_cached``) are not repeated here (docs/metrics.md "Counters").
_H = _LATENCY_BUCKETS
_SENT, _RECEIVED = ("prefill",), ("decode",)
METRICS = (
    # gauges set from each stats snapshot
    Metric("running", "gauge", "pdserve:num_requests_running", "Requests in the running batch", stat="num_running"),
    Metric("waiting", "gauge", "pdserve:num_requests_waiting", "Requests waiting for the engine", stat="num_waiting"),
    Metric("kv_usage", "gauge", "pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)",
           stat="kv_cache_usage"),
    Metric("kv_blocks_used", "gauge", "pdserve:kv_blocks_used", "KV blocks held by requests", stat="kv_blocks_used"),
    # preemption by swap made visible: vLLM v0's names, plus the pool in blocks
    Metric("swapped", "gauge", "pdserve:num_requests_swapped", "Requests whose KV is in the CPU swap pool",
           stat="num_requests_swapped"),
    Metric("cpu_usage", "gauge", "pdserve:cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (0..1)"),
    Metric("cpu_blocks_used", "gauge", "pdserve:cpu_swap_blocks_used", "CPU swap blocks holding a preempted "
           "request's KV", stat="cpu_swap_blocks_used"),
    Metric("cpu_blocks_total", "gauge", "pdserve:cpu_swap_blocks_total", "CPU swap blocks (0: recompute preemption)",
           stat="cpu_swap_blocks_total"),
    # vLLM's cache_config_info: value 1, the configuration in labels
    Metric("cache_config", "gauge", "pdserve:cache_config_info", "KV cache configuration (labels; value 1)",
           ("preemption_mode", "block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching")),
    # counters that follow an engine total
    Metric("prompt_tokens_computed", "counter", "pdserve:prompt_tokens_computed",
           "Prompt tokens run through the model (not prefix-cache hits, not recompute)", stat="prompt_tokens_computed"),
    Metric("prompt_tokens_recomputed", "counter", "pdserve:prompt_tokens_recomputed",
           "Tokens run through the model again after a recompute preemption", stat="prompt_tokens_recomputed"),
    Metric("sampled_tokens", "counter", "pdserve:sampled_tokens",
           "Tokens this pod sampled (prefill pod: each request's first; decode pod: the rest)", stat="sampled_tokens"),
    Metric("prefix_cache_queries", "counter", "pdserve:prefix_cache_queries",
           "Prompt tokens of new requests looked up in the prefix cache before computing", stat="prefix_cache_queries"),
    Metric("prefix_cache_hits", "counter", "pdserve:prefix_cache_hits", "Of those, tokens found cached (not computed)",
           stat="prefix_cache_hits"),
    Metric("prefix_cache_preempted_queries", "counter", "pdserve:prefix_cache_preempted_queries",
           "Tokens of recompute-preempted requests looked up again on resume", stat="prefix_cache_preempted_queries"),
    Metric("prefix_cache_preempted_hits", "counter", "pdserve:prefix_cache_preempted_hits",
           "Of those, tokens found again (recompute saved)", stat="prefix_cache_preempted_hits"),
    Metric("prefix_cache_transfer_queries", "counter", "pdserve:kv_transfer_prefix_cache_queries",
           "Prompt tokens of KV reservations looked up in this decode pod's cache",
           stat="prefix_cache_transfer_queries"),
    Metric("prefix_cache_transfer_hits", "counter", "pdserve:kv_transfer_prefix_cache_hits",
           "Of those, tokens already here (their KV was not sent)", stat="prefix_cache_transfer_hits"),
    Metric("num_preemptions", "counter", "pdserve:num_preemptions", "Preemptions", stat="num_preemptions"),
    Metric("kv_blocks_swapped_out", "counter", "pdserve:kv_blocks_swapped_out", "KV blocks copied to the CPU swap pool",
           stat="kv_blocks_swapped_out"),
    Metric("kv_blocks_swapped_in", "counter", "pdserve:kv_blocks_swapped_in",
           "KV blocks copied back from the CPU swap pool", stat="kv_blocks_swapped_in"),
    # speculative decoding (vLLM's names; 0 without a speculative_config)
    Metric("spec_decode_num_drafts", "counter", "pdserve:spec_decode_num_drafts",
           "Verification steps of requests with draft tokens", stat="spec_decode_num_drafts"),
    Metric("spec_decode_num_draft_tokens", "counter", "pdserve:spec_decode_num_draft_tokens",
           "Draft tokens proposed and verified", stat="spec_decode_num_draft_tokens"),
    Metric("spec_decode_num_accepted_tokens", "counter", "pdserve:spec_decode_num_accepted_tokens",
           "Draft tokens accepted", stat="spec_decode_num_accepted_tokens"),
    Metric("spec_per_pos", "counter", "pdserve:spec_decode_num_accepted_tokens_per_pos",
           "Draft tokens accepted, by position in the draft (0 first)", ("position",)),
    # latency, measured on this tier (a worker's clock starts when the request reached it)
    Metric("ttft", "histogram", "pdserve:time_to_first_token_seconds", "Arrival to first token", buckets=_H),
    Metric("itl", "histogram", "pdserve:inter_token_latency_seconds", "Time between output events", buckets=_H),
    Metric("e2e", "histogram", "pdserve:e2e_request_latency_seconds", "Arrival to last token", buckets=_H),
    Metric("queue_time", "histogram", "pdserve:request_queue_time_seconds", "Arrival to being taken from the queue",
           buckets=_H),
    Metric("prefill_time", "histogram", "pdserve:request_prefill_time_seconds", "Taken from the queue to first token",
           buckets=_H),
    Metric("first_decode_step", "histogram", "pdserve:first_decode_step_seconds",
           "KV hand-over committed to the decode pod's first token", buckets=_H),
    # KV transfer: sent on a prefill pod, received on a decode pod: two names, so a sum over pods counts a block once
    Metric("kv_transfer_bytes", "counter", "pdserve:kv_transfer_sent_bytes", "KV bytes sent", roles=_SENT),
    Metric("kv_transfer_bytes", "counter", "pdserve:kv_transfer_received_bytes", "KV bytes received",
           roles=_RECEIVED),
    Metric("kv_transfer_blocks", "counter", "pdserve:kv_transfer_sent_blocks", "KV blocks sent", roles=_SENT),
    Metric("kv_transfer_blocks", "counter", "pdserve:kv_transfer_received_blocks", "KV blocks received",
           roles=_RECEIVED),
    Metric("kv_transfer_seconds", "histogram", "pdserve:kv_transfer_seconds", "Time to transfer one request's KV",
           buckets=_H),
    Metric("kv_transfer_blocks_skipped", "counter", "pdserve:kv_transfer_blocks_skipped",
           "KV blocks not sent because the decode pod held them"),
    Metric("queue_depth", "gauge", "pdserve:prefill_queue_depth", "Messages in the prefill queue"),
    Metric("queue_tokens", "gauge", "pdserve:prefill_queue_tokens",
           "Prompt tokens taken from the queue, not yet prefilled"),
    Metric("requests_failed", "counter", "pdserve:request_failures", "Requests that ended with an error"),
    Metric("requests_orphaned", "counter", "pdserve:requests_orphaned",
           "Requests dropped because the router relaying them is gone"),
    # offloading tiers (pdserve/shared/engine/kv_offload.py): ``stat`` is the ``TierStats`` field, per ``tier``
    *(Metric(f"offload_{key}", "counter", f"pdserve:kv_offload_{key}", doc, ("tier",), stat=key) for key, doc in (
        ("hit_tokens", "Prompt tokens whose KV was loaded back from this tier (part of prefix_cache_hits)"),
        ("bytes_written", "KV bytes written to this tier"),
        ("bytes_loaded", "KV bytes loaded back from this tier into the pool"),
        ("blocks_loaded", "KV blocks loaded back from this tier"),
        ("load_seconds", "Time spent loading blocks back from this tier (s; divide by blocks_loaded for the mean)"),
        ("evictions", "KV blocks pushed out of this tier (CPU: on to disk, if any; disk: dropped)"),
        ("bad_files", "Torn, corrupted or foreign block files skipped (never loaded)"),
        ("writes_refused", "Block writes the tier refused (disk full, I/O error); serving went on without them"),
        ("stores_skipped", "Evicted KV blocks not written to this tier: looked up fewer than store_threshold times"))),
    *(Metric(f"offload_{key}", "gauge", f"pdserve:kv_offload_{key}", doc, ("tier",), stat=key) for key, doc in (
        ("blocks_used", "KV blocks this tier holds"), ("blocks_total", "KV blocks this tier can hold"))),
)
BASE_LABELS = ("role", "pod")

# the queries/hits counters count only new requests' lookups: the engine's totals include a decode pod's reservations
_DERIVED = {
    "prefix_cache_queries": lambda s: s.prefix_cache_queries - s.prefix_cache_transfer_queries,
    "prefix_cache_hits": lambda s: s.prefix_cache_hits - s.prefix_cache_transfer_hits,
}


class WorkerMetrics:
    """A worker's metrics (``METRICS``), each an attribute by its row's ``attr``; ``update_from_stats`` follows an
    ``EngineStats`` snapshot."""

    def __init__(self, role: str, pod_id: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"role": role, "pod": pod_id}
        self._metrics = build(METRICS, self.registry, self.labels, role)
        for attr, metric in self._metrics.items():
            setattr(self, attr, metric)
        self._rows = [row for row in METRICS if row.attr in self._metrics and (row.roles is None or role in row.roles)]
        self._config_labels: dict | None = None
        self._last: dict[str, float] = {}
        self._last_per_pos: list[int] = []

    def update_from_stats(self, stats: EngineStats) -> None:
        for row in self._rows:
            if row.stat is None or row.labels:
                continue
            metric = self._metrics[row.attr]
            value = _DERIVED[row.stat](stats) if row.stat in _DERIVED else getattr(stats, row.stat)
            if row.kind == "gauge":
                metric.set(value)
            else:
                self._advance(metric, row.stat, value)
        cpu_total = stats.cpu_swap_blocks_total
        self.cpu_usage.set(stats.cpu_swap_blocks_used / cpu_total if cpu_total else 0.0)
        if self._config_labels is None:
            self._config_labels = {**self.labels, "preemption_mode": stats.preemption_mode,
                                   "block_size": str(stats.block_size), "num_gpu_blocks": str(stats.kv_blocks_total),
                                   "num_cpu_blocks": str(cpu_total),
                                   "enable_prefix_caching": str(stats.enable_prefix_caching).lower()}
            self.cache_config.labels(**self._config_labels).set(1)
        self._update_offload(stats)
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        for pos, value in enumerate(per_pos):
            last = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
            if value > last:
                self.spec_per_pos.labels(**self.labels, position=str(pos)).inc(value - last)
        self._last_per_pos = list(per_pos)

    def _advance(self, counter, key: str, value: float) -> None:
        # the engine keeps totals; a counter advances by the difference (never back: an engine restart is a new pod)
        delta = value - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = value

    def _update_offload(self, stats: EngineStats) -> None:
        for tier, tier_stats in stats.offload.items():
            for row in self._rows:
                if "tier" not in row.labels:
                    continue
                child = self._metrics[row.attr].labels(**self.labels, tier=tier)  # shown at 0 from the first update
                value = getattr(tier_stats, row.stat)
                if row.kind == "gauge":
                    child.set(value)
                else:
                    self._advance(child, f"{tier}.{row.stat}", value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
