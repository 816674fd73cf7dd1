"""How many KV blocks an engine gets, and the context limit that follows: a pure function of its config.

``num_kv_blocks`` wins; else ``kv_cache_memory_bytes``; else 256 MiB, raised to hold one full-length
sequence. With a speculative draft model, whose KV pool has one block per target block
(``spec_decode/draft_model.py``), a block's bytes are the target's plus the draft's, so the memory holds both. Block 0 is the null block, so a pool of ``num_blocks`` holds ``(num_blocks - 1) * block_size``
tokens; ``max_model_len`` defaults to the smaller of that and the model's ``max_position_embeddings``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.kv_cache import KVCacheSpec

DEFAULT_KV_CACHE_BYTES = 256 * 1024**2


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """``num_blocks``: device blocks including the null block; ``num_cpu_blocks``: the swap pool (0 under
    recompute); ``max_model_len``: tokens per request (prompt + output)."""

    num_blocks: int
    num_cpu_blocks: int
    max_model_len: int


def plan_kv_cache(config: EngineConfig, model_config, kv_spec: KVCacheSpec,
                  draft_bytes_per_block: int = 0) -> KVCachePlan:
    """Size the KV pools for ``config`` (``model_config``: anything with ``max_position_embeddings``,
    8192 when absent; ``draft_bytes_per_block``: a draft model's KV bytes per block, 0 without one). Raises
    ``ValueError`` when the memory holds no block, or ``max_model_len`` exceeds the model's positions or the pool."""
    model_max = int(getattr(model_config, "max_position_embeddings", 8192))
    bs = config.block_size
    per_block = kv_spec.bytes_per_block + draft_bytes_per_block
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = 1 + config.kv_cache_memory_bytes // per_block
    else:
        wanted = config.max_model_len or model_max
        num_blocks = 1 + max(DEFAULT_KV_CACHE_BYTES // per_block, -(-wanted // bs))
    if num_blocks < 2:
        with_draft = f" with the draft model's {draft_bytes_per_block}" if draft_bytes_per_block else ""
        raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no KV block "
                         f"({per_block} bytes each{with_draft})")
    capacity = (num_blocks - 1) * bs
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = min(model_max, capacity)
    elif max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")
    elif max_model_len > capacity:
        raise ValueError(f"max_model_len={max_model_len} does not fit in the KV cache ({num_blocks - 1} blocks x "
                         f"{bs} = {capacity} tokens); raise kv_cache_memory_bytes or lower max_model_len")
    num_cpu_blocks = kv_spec.num_blocks_for(config.swap_space_bytes) if config.preemption_mode == "swap" else 0
    return KVCachePlan(num_blocks, num_cpu_blocks, max_model_len)
