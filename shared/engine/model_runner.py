"""Turns a ``SchedulerOutput`` into one forward pass: flat inputs, attention metadata, logits.

Inputs are vLLM v1's: ``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``, ``seq_lens``,
``query_start_loc``. Logits are computed only for the rows that sample this step (the last token of
every request whose known tokens are now all computed); prefill chunks that stop short sample nothing.
"""

from __future__ import annotations

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.shared.engine.kv_cache import KVCache
from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, kv_manager: KVCacheManager, device: str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.block_size = kv_cache.spec.block_size
        self.device = device
        self.kv_caches = [kv_cache.layer(i) for i in range(kv_cache.spec.num_layers)]

    def prepare_inputs(self, out: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        for request, n in out.scheduled:
            start = request.num_computed_tokens
            end = start + n
            blocks = self.kv_manager.get_block_ids(request.request_id)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(blocks)
            seq_lens.append(end)
            query_lens.append(n)
            if end >= request.num_tokens:
                sample_rows.append(len(input_ids) - 1)
        width = max(len(t) for t in tables)
        dev = self.device
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        md.cache["qsl"] = qsl
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, md, sample_rows

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step; returns logits ``[num_sampling_requests, vocab]`` float32, in batch order."""
        self.kv_cache.swap_out(out.blocks_to_swap_out)
        self.kv_cache.swap_in(out.blocks_to_swap_in)
        self.kv_cache.copy_blocks(out.blocks_to_copy)
        ids, pos, md, sample_rows = self.prepare_inputs(out)
        hidden = self.model(ids, pos, self.kv_caches, md)
        if not sample_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
