"""Turns a ``SchedulerOutput`` into one forward pass: flat inputs, attention metadata, logits.

Inputs are vLLM v1's: ``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``, ``seq_lens``,
``query_start_loc``. Logits are computed only for the rows that sample this step (the last token of
every request whose known tokens are now all computed, and each of its draft tokens when it speculates);
prefill chunks that stop short sample nothing.
A request that asks for ``prompt_logprobs`` also gets the logits of every prompt position the step computes
(each chunk of a chunked prefill adds its own), which ``execute_model`` returns beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.shared.engine.cuda_graphs import DecodeGraphRunner
from pdserve.shared.engine.kv_cache import KVCache
from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import Request
from pdserve.shared.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class PromptLogits:
    """Logits ``[m, vocab]`` float32 of ``m`` consecutive prompt positions of ``request``; row ``i`` predicts
    prompt token ``first_target + i`` (the position before it is the one computed)."""

    request: Request
    first_target: int
    logits: torch.Tensor


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, kv_manager: KVCacheManager, device: str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.block_size = kv_cache.spec.block_size
        self.device = device
        self.kv_caches = [kv_cache.layer(i) for i in range(kv_cache.spec.num_layers)]
        self.tp_workers = getattr(kv_cache, "tp_workers", None)  # tensor parallelism: ranks 1..N-1 run each step too
        # pure-decode steps that fit go through it (CUDA graphs, pdserve/shared/engine/cuda_graphs.py); None: all eager
        self.graphs: DecodeGraphRunner | None = None

    def prepare_inputs(self, out: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (request, first flat row, first target, count)
        for request, n in out.scheduled:
            start = request.num_computed_tokens
            end = start + n
            if request.prompt_logprobs is not None:
                # position p predicts prompt token p + 1; skip targets already recorded (a recompute after
                # preemption runs the prompt again)
                first = max(start + 1, len(request.prompt_logprobs))
                last = min(end, request.num_prompt_tokens - 1)  # last target, inclusive
                if last >= first:
                    prompt_rows.append((request, len(input_ids) + first - 1 - start, first, last - first + 1))
            blocks = self.kv_manager.get_block_ids(request.request_id)
            spec = out.spec_token_ids.get(request.request_id)
            input_ids.extend((request.all_token_ids + spec if spec else request.all_token_ids)[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(blocks)
            seq_lens.append(end)
            query_lens.append(n)
            if end >= request.num_tokens:  # the last known token, then one row per draft token
                sample_rows.extend(range(len(input_ids) - 1 - (end - request.num_tokens), len(input_ids)))
        dev = self.device
        md = AttentionMetadata.from_lists(slot_mapping, tables, seq_lens, query_lens, bs, dev)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, md, sample_rows, prompt_rows

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[PromptLogits]]:
        """Run the step; returns logits ``[num_sampling_rows, vocab]`` float32 in batch order (one row per sampling
        request, 1 + k for one verifying k drafts), and the
        prompt positions' logits of requests that asked for ``prompt_logprobs`` (empty list otherwise)."""
        self.kv_cache.swap_out(out.blocks_to_swap_out)
        self.kv_cache.swap_in(out.blocks_to_swap_in)
        ids, pos, md, sample_rows, prompt_rows = self.prepare_inputs(out)
        if self.tp_workers is not None:  # every rank runs the step; one that dies or hangs in it: TPRankDied
            self.tp_workers.step(ids, pos, md)
            hidden = self.tp_workers.guarded(self.model, ids, pos, self.kv_caches, md)
        elif self.graphs is not None and self.graphs.fits(md):
            hidden = self.graphs.run(ids, pos, md)
        else:
            hidden = self.model(ids, pos, self.kv_caches, md)
        prompt_logits = [PromptLogits(request, target, self.model.compute_logits(hidden[row:row + count]))
                         for request, row, target, count in prompt_rows]
        if not sample_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), prompt_logits
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)]), prompt_logits
