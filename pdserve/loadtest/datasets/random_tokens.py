"""Random token ids from the model's vocabulary, lengths drawn like vLLM's ``random`` dataset.

Input length is uniform in ``[input_len*(1-r), input_len*(1+r)]`` (r = ``range_ratio``), same for
output; an optional shared ``prefix_len`` is prepended to every prompt. Each prompt has its own
generator seeded by ``(seed, index)``, so prompt i never depends on how many others were made.
"""

from __future__ import annotations

import numpy as np

from pdserve.loadtest.request import SampleRequest
from pdserve.loadtest.tokenization import PromptMaker, gather_limited


def draw_lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> np.ndarray:
    lo = max(int(mean * (1 - ratio)), 1)
    hi = max(int(mean * (1 + ratio)), lo)
    return rng.integers(lo, hi + 1, size=n)


async def build(spec, maker: PromptMaker) -> list[SampleRequest]:
    rng = np.random.default_rng([spec.seed, 0])
    in_lens = draw_lengths(rng, spec.num_prompts, spec.input_len, spec.range_ratio)
    out_lens = draw_lengths(rng, spec.num_prompts, spec.output_len, spec.range_ratio)
    prefix = ""
    if spec.prefix_len > 0:
        prefix, _ = await maker.make(np.random.default_rng([spec.seed, 1]), spec.prefix_len)

    async def one(i: int) -> SampleRequest:
        text, n = await maker.make(np.random.default_rng([spec.seed, 2, i]),
                                   int(in_lens[i]) + spec.prefix_len, prefix)
        return SampleRequest(prompt=text, prompt_len=n, expected_output_len=int(out_lens[i]))

    return list(await gather_limited(one(i) for i in range(spec.num_prompts)))
