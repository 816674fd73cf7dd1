"""The engine's running totals and peaks, and the gauges ``LLMEngine.get_stats`` reports beside them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class EngineCounters:
    """Totals in tokens unless named otherwise. ``prompt_tokens_computed``: prompt tokens run through the model
    the first time; ``prompt_tokens_recomputed``: tokens run again after a recompute preemption;
    ``generation_tokens``: tokens appended as output (a decode pod counts the first token the prefill pod handed
    over); ``sampled_tokens``: tokens this engine sampled itself. ``peak_*``: highest since the last
    ``reset_peaks``."""

    prompt_tokens_computed: int = 0
    prompt_tokens_recomputed: int = 0
    generation_tokens: int = 0
    sampled_tokens: int = 0
    peak_kv_blocks_used: int = 0
    peak_kv_tokens_live: int = 0
    peak_num_running: int = 0
    num_steps: int = 0

    def count_scheduled(self, out: SchedulerOutput) -> None:
        """Split the step's prompt tokens into first computations and recomputations."""
        for request, n in out.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + n
            self.prompt_tokens_recomputed += max(0, min(end, request.num_tokens_to_recompute) - start)
            self.prompt_tokens_computed += max(0, min(end, request.num_prompt_tokens)
                                               - max(start, request.num_tokens_to_recompute))

    def track_peaks(self, scheduler: Scheduler, kv: KVCacheManager) -> None:
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, kv.num_used_blocks)
        self.peak_kv_tokens_live = max(self.peak_kv_tokens_live, live_tokens(scheduler))
        self.peak_num_running = max(self.peak_num_running, len(scheduler.running))
        self.num_steps += 1

    def reset_peaks(self) -> None:
        self.peak_kv_blocks_used = self.peak_kv_tokens_live = self.peak_num_running = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def live_tokens(scheduler: Scheduler) -> int:
    """Tokens whose KV the running batch holds."""
    return sum(r.num_computed_tokens for r in scheduler.running)


def kv_and_scheduler_stats(scheduler: Scheduler, kv: KVCacheManager) -> dict:
    """Gauges and totals of the KV pool, the prefix cache (``PrefixCacheStats``), preemption and the swap pool
    (``cpu_swap_blocks_*``, ``kv_blocks_swapped_*``: 0 under recompute)."""
    pcs = kv.prefix_cache_stats
    swap = scheduler.swap
    return {
        "kv_blocks_total": kv.num_used_blocks + kv.num_free_blocks,
        "kv_blocks_used": kv.num_used_blocks,
        "kv_cache_usage": kv.usage,
        "kv_tokens_live": live_tokens(scheduler),
        # new requests' lookups plus a decode pod's reservations (KV not sent); never a recompute's
        "prefix_cache_queries": pcs.queries + pcs.transfer_queries,
        "prefix_cache_hits": pcs.hits + pcs.transfer_hits,
        "prefix_cache_transfer_queries": pcs.transfer_queries,
        "prefix_cache_transfer_hits": pcs.transfer_hits,
        "prefix_cache_preempted_queries": pcs.preempted_queries,
        "prefix_cache_preempted_hits": pcs.preempted_hits,
        "num_preemptions": scheduler.num_preemptions,
        "preemption_mode": scheduler.preemption_mode,
        "num_requests_swapped": scheduler.num_swapped,
        "cpu_swap_blocks_total": swap.num_cpu_blocks if swap is not None else 0,
        "cpu_swap_blocks_used": swap.num_used_cpu_blocks if swap is not None else 0,
        "kv_blocks_swapped_out": scheduler.num_blocks_swapped_out,
        "kv_blocks_swapped_in": scheduler.num_blocks_swapped_in,
        "enable_prefix_caching": kv.enable_caching,
        "num_running": len(scheduler.running),
        "num_waiting": scheduler.num_waiting,
    }
