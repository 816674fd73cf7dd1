"""The prompt-logprob oracle: HF transformers' log-softmax over the same prompt, in fp32."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def _model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_prompt_logprobs(model_dir, ids: list[int]) -> list[tuple[float, int]]:
    """For prompt tokens 1.. of ``ids``: (logprob of the token given the ones before it, its rank: 1 + the
    number of tokens strictly more likely). Token 0 has none (vLLM's ``None``)."""
    import torch

    with torch.inference_mode():
        logits = _model(str(model_dir))(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    out = []
    for i in range(1, len(ids)):
        value = lp[i - 1, ids[i]]
        out.append((value.item(), int((lp[i - 1] > value).sum()) + 1))
    return out
