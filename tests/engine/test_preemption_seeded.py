"""Seeded and greedy output do not depend on preemption, and preemption is visible in the stats.

Oracle: the same engine given room to spare (no preemption). Sampling uses ``top_k`` so that the float noise
of a different batch shape (a recompute prefills what was decoded one token at a time) cannot move a draw
across a candidate boundary; a logic error (KV lost or mixed up) changes the text within a few tokens.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

SEEDED = SamplingParams(temperature=0.8, top_k=8, seed=7, n=4, max_tokens=16, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tiny(mode: str, blocks: int, **kw) -> LLM:
    return LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=blocks, max_model_len=128,
               preemption_mode=mode, swap_space_bytes="16MiB", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_step_that_preempts_everything_still_swaps_out(mode, prompt_of):
    # A decode pod's reservation (KV on its way from a prefill pod) takes every free block, so the running
    # request preempts itself and the step schedules nothing. Its swap-out must still copy the KV to the CPU
    # pool; before the fix it was dropped and the request resumed from CPU blocks that never got its KV.
    llm = _tiny(mode, 13, enable_prefix_caching=False)  # no cache hits: the oracle run computes the same way
    params = SamplingParams(temperature=0.8, top_k=8, seed=7, max_tokens=20, ignore_eos=True)
    prompt = prompt_of(37)
    want = llm.generate([prompt], params)[0].outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("a", prompt, params)
    (request,) = engine.output.states["a"].members
    while request.num_output_tokens < 5:
        engine.step()
    free = engine.kv_manager.num_free_blocks
    assert engine.reserve("incoming", [7] * (free * 16)) is not None
    for _ in range(16):  # reaches the next block boundary: preempted, then waits for blocks
        engine.step()
    stats = engine.get_stats()
    assert stats.num_preemptions == 1 and stats.preemption_mode == mode
    if mode == "swap":
        assert stats.num_requests_swapped == 1 and stats.cpu_swap_blocks_used == 3
        assert stats.kv_blocks_swapped_out == 3 and stats.cpu_swap_blocks_total > 0
    engine.release_reservation("incoming")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["a"].outputs[0].token_ids == want
    stats = engine.get_stats()
    assert stats.cpu_swap_blocks_used == 0 and stats.kv_blocks_used == 0
    assert stats.kv_blocks_swapped_in == stats.kv_blocks_swapped_out == (3 if mode == "swap" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_n4_and_greedy_survive_preemption(mode, prompt_of):
    prompts = [prompt_of(37), prompt_of(21, offset=3)]
    roomy = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=128)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, [SEEDED, GREEDY])]
    assert roomy.get_stats().num_preemptions == 0
    llm = _tiny(mode, 9)  # 5 sequences of up to 53 tokens need ~13 blocks (prompt blocks shared); 8 here
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, [SEEDED, GREEDY])]
    assert got == want
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.cpu_swap_blocks_used == 0
    # a recomputed request's own blocks found again are recompute savings, never prefix-cache hits (17.2): each
    # choice was looked up once as new; in this fresh engine only the n=4 siblings of the first choice hit (its
    # two full prompt blocks, admitted in the same first step)
    assert stats.prefix_cache_queries == 4 * 37 + 21
    assert stats.prefix_cache_hits == 3 * 32
    if mode == "recompute":
        assert stats.prompt_tokens_recomputed > 0 and stats.prefix_cache_preempted_queries > 0
    else:
        assert stats.kv_blocks_swapped_in == stats.kv_blocks_swapped_out > 0
    assert stats.prompt_tokens_computed + stats.prefix_cache_hits == stats.prefix_cache_queries
