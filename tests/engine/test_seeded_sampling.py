"""A seeded request samples the same tokens whatever runs beside it.

Oracle: the same seeded requests run on their own. Sampling is over the whole vocabulary at temperature 1
(top_k=-1, top_p=1), where fp32 noise matters most: another batch shape (other neighbours, another order), a
prefix-cache hit (only the prompt's tail prefilled) or a resume after a move (the output so far prefilled in one
pass instead of decoded token by token) changes the logits in their last bits. Inverse-CDF sampling flipped
about 1% of such draws; the exponential race must not.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

SEEDS = range(1, 9)


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, seed=seed, max_tokens=24, ignore_eos=True)


def _run(engine, requests) -> dict[str, list[int]]:
    """requests: (request_id, prompt ids, params, cache_salt) -> {request_id: output token ids}."""
    for rid, prompt, params, salt in requests:
        engine.add_request(rid, prompt, params, cache_salt=salt)
    out = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    return out


@pytest.mark.slow
def test_seeded_tokens_do_not_depend_on_batch_neighbours_or_prefix_cache_hits(prompt_of):
    engine = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=256).llm_engine
    prompts = {s: prompt_of(40, offset=9 * s) for s in SEEDS}

    def seeded(tag: str, salt: str) -> list:
        return [(f"{tag}-{s}", prompts[s], _seeded(s), f"{salt}-{s}") for s in SEEDS]

    def tokens(out: dict, tag: str) -> list[list[int]]:
        return [out[f"{tag}-{s}"] for s in SEEDS]

    # own salts: no prefix-cache hit until the last run
    alone = tokens(_run(engine, seeded("ref", "a")), "ref")
    assert _run(engine, seeded("one", "b")[:1])["one-1"] == alone[0]
    neighbours = [
        ("greedy", prompt_of(70, offset=3), SamplingParams(temperature=0, max_tokens=20), "n"),
        ("unseeded", prompt_of(25, offset=50), SamplingParams(temperature=0.8, max_tokens=24), "n"),
        ("top-k", prompt_of(33, offset=90), SamplingParams(temperature=1.0, top_k=5, seed=9, max_tokens=12), "n"),
    ]
    assert tokens(_run(engine, neighbours[:2] + seeded("batch", "c")[::-1] + neighbours[2:]), "batch") == alone

    assert engine.get_stats().prefix_cache_hits == 0
    # salts "a" again: 32 of each 40-token prompt are cached (and 16 of the unseeded neighbour's 25)
    assert tokens(_run(engine, seeded("hit", "a")[::2] + neighbours[1:2] + seeded("hit", "a")[1::2]), "hit") == alone
    assert engine.get_stats().prefix_cache_hits == 32 * len(SEEDS) + 16

    # resumed after 6 tokens (a migration): their KV recomputed by one prefill, the generator skipped 6 draws
    for s, want in zip(SEEDS, alone):
        engine.add_request(f"resume-{s}", prompts[s], _seeded(s), cache_salt=f"d-{s}", output_token_ids=want[:6])
    resumed = {}
    while engine.has_unfinished_requests():
        resumed.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    assert tokens(resumed, "resume") == alone
