"""Multi-turn chat sessions: each turn is a new user message sent with the whole conversation so far.

``num_prompts`` turns make ``ceil(num_prompts / turns)`` sessions. The dataset holds each turn's user
message (``input_len`` random tokens); the runner sends turn k of a session only after turn k-1 has
finished and prepends the earlier user messages with the server's actual answers, so later turns
re-send (and a prefix cache can reuse) everything before them. Requests are ordered turn-major (every
session's first turn, then every second turn, ...) so sessions overlap in time.
"""

from __future__ import annotations

import math

import numpy as np

from pdserve.loadtest.request import SampleRequest
from pdserve.loadtest.tokenization import PromptMaker, gather_limited


async def build(spec, maker: PromptMaker) -> list[SampleRequest]:
    turns = max(1, spec.turns)
    sessions = math.ceil(spec.num_prompts / turns)
    # turn-major; a short last row only drops final turns, so every kept turn has its predecessors
    keep = [(s, t) for t in range(turns) for s in range(sessions)][: spec.num_prompts]

    async def one(s: int, t: int) -> SampleRequest:
        text, n = await maker.make(np.random.default_rng([spec.seed, 20, s, t]), spec.input_len)
        return SampleRequest(prompt=text, prompt_len=n, expected_output_len=spec.output_len,
                             label=spec.label or f"turn{t}", session_id=s, turn=t)

    return list(await gather_limited(one(s, t) for s, t in keep))
