"""The engine's running totals and peaks, and ``EngineStats``: the typed snapshot ``LLMEngine.get_stats`` returns.

Stats cross from the engine thread to the worker (metrics, heartbeats, ``/v1/stats``) as one frozen dataclass, so a
misspelled name is an ``AttributeError`` where a dict would have read 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class EngineCounters:
    """Totals in tokens unless named otherwise. ``prompt_tokens_computed``: prompt tokens run through the model
    the first time; ``prompt_tokens_recomputed``: tokens run again after a recompute preemption;
    ``generation_tokens``: tokens appended as output (a decode pod counts the first token the prefill pod handed
    over); ``sampled_tokens``: tokens this engine sampled itself. ``peak_*``: highest since the last
    ``reset_peaks``. ``busy_seconds``: wall seconds of the steps that ran the model (a prefill pod's prompt
    tokens per busy second is its measured prefill rate, which routers use to estimate TTFT)."""

    prompt_tokens_computed: int = 0
    prompt_tokens_recomputed: int = 0
    generation_tokens: int = 0
    sampled_tokens: int = 0
    peak_kv_blocks_used: int = 0
    peak_kv_tokens_live: int = 0
    peak_num_running: int = 0
    num_steps: int = 0
    busy_seconds: float = 0.0

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

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One snapshot of an engine: gauges (``num_*``, ``kv_blocks_*``, ``kv_cache_usage`` in 0..1) and running totals
    (tokens unless named otherwise; ``EngineCounters``, ``kv_and_scheduler_stats``). ``spec_decode_*`` are vLLM's
    speculative-decoding counters (0 without a ``speculative_config``; ``SpecDecoder.get_stats``); ``offload`` maps
    a tier name (``cpu``, ``disk``) to its ``TierStats`` (empty without offloading tiers)."""

    # the KV pool and the scheduler, now
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_cache_usage: float = 0.0
    kv_tokens_live: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_requests_swapped: int = 0
    cpu_swap_blocks_total: int = 0
    cpu_swap_blocks_used: int = 0
    # configuration
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    block_size: int = 0
    max_model_len: int = 0
    tensor_parallel_size: int = 1
    # totals: the prefix cache (new requests' lookups plus a decode pod's reservations), preemption, swap
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_transfer_queries: int = 0
    prefix_cache_transfer_hits: int = 0
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    num_preemptions: int = 0
    kv_blocks_swapped_out: int = 0
    kv_blocks_swapped_in: int = 0
    # totals and peaks: EngineCounters
    prompt_tokens_computed: int = 0
    prompt_tokens_recomputed: int = 0
    generation_tokens: int = 0
    sampled_tokens: int = 0
    peak_kv_blocks_used: int = 0
    peak_kv_tokens_live: int = 0
    peak_num_running: int = 0
    num_steps: int = 0
    busy_seconds: float = 0.0
    # speculative decoding
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    spec_decode_acceptance_rate: float = 0.0
    spec_decode_mean_accepted_length: float = 0.0
    # offloading tiers: tier name -> TierStats (pdserve/shared/engine/kv_offload.py)
    offload: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The wire form (``/v1/stats``): every field by name, ``spec_decode_num_accepted_tokens_per_pos`` as a list,
        and each tier's stats flattened to ``kv_offload_<tier>_<stat>``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "offload"}
        out["spec_decode_num_accepted_tokens_per_pos"] = list(self.spec_decode_num_accepted_tokens_per_pos)
        for tier, stats in self.offload.items():
            out.update({f"kv_offload_{tier}_{k}": v for k, v in asdict(stats).items()})
        return out


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
