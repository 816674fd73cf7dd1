"""The engine's model and KV cache: in this process (one device), or split over tensor-parallel ranks.

``build_executor`` sizes the KV pool (``plan_kv_cache``) and loads the model for ``EngineConfig``. With
``tensor_parallel_size`` N > 1 it starts ranks 1..N-1 (``tp_executor``): the model returned is rank 0's shard and
the KV cache rank 0's view that forwards block operations to every rank, so the engine above runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.kv_cache import KVCache, KVCacheSpec
from pdserve.shared.engine.kv_plan import KVCachePlan, plan_kv_cache
from pdserve.shared.models.loader import load_model


@dataclass
class Executor:
    plan: KVCachePlan
    backend: object  # the attention backend (pdserve/kernels/backend.py)
    model: torch.nn.Module
    kv_cache: object  # KVCache, or tp_executor.TPKVCache under tensor parallelism
    tp: object | None  # tp_executor.TPWorkers: rank 0's handle on the other ranks; None at N = 1


def build_executor(config: EngineConfig, model_dir: str, model_config, dtype: torch.dtype,
                   kv_spec: KVCacheSpec, draft_bytes_per_block: int = 0) -> Executor:
    """Plan the KV pool and load the model (and start the ranks at N > 1). ``draft_bytes_per_block``: a
    speculative draft model's KV bytes per block, counted in the KV memory (one process only). Raises
    ``ValueError`` for a KV budget or a tensor-parallel split that cannot work, ``TPRankDied`` when a rank fails
    to start."""
    from pdserve.kernels.backend import get_attention_backend

    backend = get_attention_backend(config.attention_backend, config.device)
    if config.tensor_parallel_size > 1:
        from pdserve.shared.engine.tp_executor import start_tensor_parallel

        tp, plan = start_tensor_parallel(config, model_dir, model_config, dtype, plan_kv_cache)
        return Executor(plan, backend, tp.model, tp.kv_cache, tp)
    plan = plan_kv_cache(config, model_config, kv_spec, draft_bytes_per_block)
    model = load_model(model_dir, model_config, backend, dtype, config.device, plan.max_model_len)
    return Executor(plan, backend, model, KVCache(kv_spec, plan.num_blocks, plan.num_cpu_blocks, config.device), None)
