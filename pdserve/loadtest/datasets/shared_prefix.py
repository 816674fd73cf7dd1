"""Groups of prompts that share a long prefix and differ in a unique suffix (SGLang's generated-shared-prefix).

``num_groups`` prefixes of ``prefix_len`` tokens; each prompt is its group's prefix plus
``suffix_len`` fresh tokens, aligned so the whole prompt has exactly ``prefix_len + suffix_len``.
Requests of all groups are shuffled with the seed, as a prefix cache meets them in production.
"""

from __future__ import annotations

import numpy as np

from pdserve.loadtest.request import SampleRequest
from pdserve.loadtest.tokenization import PromptMaker, gather_limited


async def build(spec, maker: PromptMaker) -> list[SampleRequest]:
    groups = max(1, min(spec.num_groups, spec.num_prompts))
    prefixes = await gather_limited(
        maker.make(np.random.default_rng([spec.seed, 10, g]), spec.prefix_len) for g in range(groups)
    )

    async def one(i: int) -> SampleRequest:
        g = i % groups
        text, n = await maker.make(np.random.default_rng([spec.seed, 11, i]),
                                   spec.prefix_len + spec.suffix_len, prefixes[g][0])
        return SampleRequest(prompt=text, prompt_len=n, expected_output_len=spec.output_len,
                             label=spec.label or f"group{g}")

    reqs = list(await gather_limited(one(i) for i in range(spec.num_prompts)))
    order = np.random.default_rng([spec.seed, 12]).permutation(len(reqs))
    return [reqs[j] for j in order]
