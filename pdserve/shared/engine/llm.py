"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.llm_engine import LLMEngine
from pdserve.shared.engine.outputs import RequestOutput
from pdserve.shared.engine.stats import EngineStats
from pdserve.shared.protocol.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """An engine for offline batched generation.

    ``LLM(model="smollm2-135m-instruct", dtype="float32", block_size=16, kv_cache_memory_bytes=...,
    num_kv_blocks=..., max_num_seqs=..., max_num_batched_tokens=..., max_model_len=...,
    enable_prefix_caching=True, preemption_mode="recompute", swap_space_bytes=..., scheduling_policy=...,
    attention_backend="auto", seed=0)`` — every ``EngineConfig`` field is a keyword argument.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one ``RequestOutput`` per prompt, in input order.

        A prompt is a string (tokenized with the model's tokenizer, special tokens added as the
        tokenizer does), a list of token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``.
        A list of ``SamplingParams`` gives one per prompt. Raises ``ValueError`` for an invalid prompt
        (empty, too long, unknown token ids) before anything runs. The progress bar (tqdm) shows when
        ``use_tqdm`` is true, or by default for more than 16 prompts.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        engine = self.llm_engine
        encoded = [self._encode(p) for p in prompts]
        for (text, ids), sp in zip(encoded, params):
            engine.validate_prompt(ids, sp)
        ids_in_order = []
        for i, ((text, ids), sp) in enumerate(zip(encoded, params)):
            rid = str(next(self._counter))
            engine.add_request(rid, ids, sp, prompt=text, priority=priority[i] if priority else 0)
            ids_in_order.append(rid)
        return self._run(ids_in_order, use_tqdm if use_tqdm is not None else len(prompts) > 16)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.llm_engine.tokenizer.encode(prompt)
        return None, list(prompt)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in request_ids:  # interrupted: leave nothing behind
                if rid not in finished:
                    engine.abort_request(rid)
        return [finished[rid] for rid in request_ids]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's ``LLM.reset_prefix_cache``), e.g. between benchmark turns that repeat the
        same prompts; returns False, doing nothing, while requests hold KV blocks."""
        return self.llm_engine.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        """KV and scheduling gauges and totals (``EngineStats``: ``kv_blocks_used``, ``prefix_cache_hits`` in tokens,
        ``prompt_tokens_computed``, ``num_preemptions``, ...); ``.as_dict()`` gives the flat wire form."""
        return self.llm_engine.get_stats()
