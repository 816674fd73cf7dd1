"""Tensor parallelism: N rank processes split the heads; outputs equal the single-process engine's.

Oracles: the TP=1 engine on the same model in fp32 (greedy tokens, seeded ``n > 1`` samples, speculative decoding's
greedy tokens, and per-step logits within fp32 tolerance: the ranks' partial sums add in another order), and the
exact refusal line for a split that cannot work.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from support.tiny_llama import make_tiny_llama

from pdserve import LLM, SamplingParams
from pdserve.shared.engine.tp_executor import TPRankDied
from pdserve.shared.models.tensor_parallel import TPShard, check_tp_split, owner_ranks

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # decodes grow into new blocks: preemption
SEEDED_N2 = SamplingParams(temperature=0.8, top_p=0.95, seed=7, n=2, max_tokens=10, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}
REFUSAL = ("tensor_parallel_size=2 cannot split this model (9 attention heads, 3 KV heads, intermediate size 1536): "
           "attention heads and intermediate size must be multiples of it, and KV heads a multiple of it or a "
           "divisor of it (then each KV head is replicated)")


def test_kv_heads_split_or_replicated_as_vllm_does():
    assert [TPShard(r, 3).kv_heads(3) for r in range(3)] == [(0, 1), (1, 1), (2, 1)]
    assert [TPShard(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # replicated twice
    assert [TPShard(r, 2).kv_heads(8) for r in range(2)] == [(0, 4), (4, 4)]
    assert owner_ranks(2, 4) == [(0, 0, 1), (2, 1, 1)]
    # query heads stay with their KV head: rank r's first query head maps to rank r's KV head
    for size, heads, kv in ((4, 8, 2), (3, 9, 3), (2, 8, 2)):
        for r in range(size):
            first_q = TPShard(r, size).heads(heads)[0]
            assert first_q // (heads // kv) == TPShard(r, size).kv_heads(kv)[0]
    with pytest.raises(ValueError) as e:
        check_tp_split(9, 3, 1536, 2)
    assert str(e.value) == REFUSAL


@pytest.mark.slow
def test_impossible_split_is_refused_at_start_up():
    with pytest.raises(ValueError) as e:
        LLM("smollm2-135m-instruct", dtype="float32", tensor_parallel_size=2)
    assert str(e.value) == REFUSAL


@pytest.mark.slow
def test_tp3_greedy_equals_tp1_with_prefix_cache_chunks_preemption_n_and_speculation(llm_fp32, prompt_of):
    # lengths 1..120; two prompts share a 48-token prefix (prefix cache hits), the budget of 16 chunks every prefill
    prompts = [prompt_of(1), prompt_of(48) + prompt_of(23, 60), prompt_of(120), prompt_of(48) + prompt_of(9, 90)]
    copy = prompt_of(40, 5) + prompt_of(40, 5)  # a repeated passage: the model copies on and n-gram drafts hit
    want = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts + [copy], LONG)]
    want_seeded = [[c.token_ids for c in o.outputs] for o in llm_fp32.generate(prompts[:2], SEEDED_N2)]
    # 10 usable blocks of 16 (160 tokens) cannot hold the 4 requests at once (345 tokens): the scheduler preempts
    llm = LLM("smollm2-135m-instruct", dtype="float32", tensor_parallel_size=3, num_kv_blocks=11,
              max_num_batched_tokens=16, max_model_len=160, preemption_mode="swap", swap_space_bytes="64MiB",
              speculative_config=NGRAM)
    engine = llm.llm_engine
    spec, engine.spec = engine.spec, None  # one engine (and one rank start-up) for the plain and speculative runs
    try:
        for mode in ("recompute", "swap"):
            engine.scheduler.preemption_mode = mode
            before = engine.get_stats().num_preemptions
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, LONG)]
            stats = engine.get_stats()
            assert stats.num_preemptions > before, mode
            assert got == want[:4], mode
        assert stats.kv_blocks_swapped_in > 0 and stats.prefix_cache_hits > 0
        # n > 1: sibling requests sharing the prompt's blocks, seeded sampling rows on rank 0
        assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[:2], SEEDED_N2)] == want_seeded
        # speculative decoding (n-gram, k=3): the verifying pass runs 1 + k query tokens per request on every rank,
        # and rejected drafts roll back the slots all ranks wrote; a prefix hit, 120 tokens, and n=2 on the copy
        # prompt (271 prompt tokens and 96 decoded on 160 slots: preempted while speculating)
        engine.spec = spec
        before = engine.get_stats().num_preemptions
        outs = llm.generate(prompts[1:3] + [copy], [LONG, LONG, SamplingParams(temperature=0, max_tokens=24,
                                                                                   ignore_eos=True, n=2)])
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[want[1]], [want[2]], [want[4], want[4]]]
        stats = engine.get_stats()
        assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_preemptions > before
        # a rank that dies: the next step fails at once with an error naming it, no hang on the collective
        os.kill(engine.tp.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TPRankDied, match=r"tensor-parallel rank 2 of 3 \(pid \d+\) exited with code -9"):
            llm.generate([prompt_of(5)], GREEDY)
        assert time.monotonic() - t0 < 15
    finally:
        engine.tp.close()


def _greedy_with_logits(llm: LLM, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    runner = llm.llm_engine.runner
    logits, execute = [], runner.execute_model

    def recording(out):
        result = execute(out)
        logits.append(result[0].clone())
        return result

    runner.execute_model = recording
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], logits


@pytest.mark.slow
def test_tiny_llama_tp2_and_tp4_logits_equal_tp1(tmp_path, model_dir):
    path = make_tiny_llama(tmp_path, model_dir)
    prompts = [list(range(100, 131)), list(range(7, 12)), list(range(500, 540))]
    want_tokens, want_logits = _greedy_with_logits(LLM(path, dtype="float32", max_num_batched_tokens=32), prompts)
    for tp in (2, 4):  # TP=4: each of the 2 KV heads lives on two ranks
        llm = LLM(path, dtype="float32", max_num_batched_tokens=32, tensor_parallel_size=tp)
        try:
            tokens, logits = _greedy_with_logits(llm, prompts)
            # the KV hand-over layout gathers every KV head from the ranks and scatters it back
            engine = llm.llm_engine
            blocks = [1, 2]
            data = engine.kv_cache.read_blocks(blocks)
            assert data.shape[4] == 2
            engine.kv_cache.write_blocks(blocks, data.flip(0))
            assert torch.equal(engine.kv_cache.read_blocks(blocks), data.flip(0))
        finally:
            llm.llm_engine.tp.close()
        assert tokens == want_tokens, tp
        assert len(logits) == len(want_logits)
        for got, want in zip(logits, want_logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# Run in a fresh interpreter: PDSERVE_TP_TIMEOUT_S is the user's knob, read from the environment as a pod reads it.
IDLE_SCRIPT = r"""
import json, os, signal, sys, time
from pdserve import LLM, SamplingParams
from pdserve.shared.engine.tp_executor import TPRankDied

path, idle_s = sys.argv[1], float(sys.argv[2])
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompts = [list(range(100, 131)), list(range(7, 12))]
out = {"want": [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompts, greedy)]}
llm = LLM(path, dtype="float32", tensor_parallel_size=3)
tp = llm.llm_engine.tp
out["first"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
time.sleep(idle_s)  # no order reaches the ranks meanwhile
out["alive_after_idle"] = [p.is_alive() for p in tp.procs]
try:
    out["after_idle"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
except TPRankDied as e:
    out["after_idle"] = str(e)
os.kill(tp.procs[0].pid, signal.SIGSTOP)  # rank 1 hangs: the next step must fail, not wait forever
t0 = time.monotonic()
try:
    llm.generate(prompts[:1], greedy)
    out["stopped"] = "no error"
except TPRankDied as e:
    out["stopped"] = str(e)
out["stopped_s"] = time.monotonic() - t0
tp.close()
out["closed"] = [p.exitcode for p in tp.procs]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_idle_tp3_engine_serves_after_twice_the_timeout_and_a_stopped_rank_fails_the_step(tmp_path, model_dir):
    # the ranks waited for rank 0's next order under PDSERVE_TP_TIMEOUT_S, so an engine idle that long
    # lost them and the next generate raised TPRankDied. A rank that hangs inside a step must still fail it.
    import json
    import subprocess
    import sys

    timeout_s = 4
    path = make_tiny_llama(tmp_path / "tiny", model_dir, heads=(6, 3))  # 2 heads and 1 KV head per rank
    run = subprocess.run([sys.executable, "-c", IDLE_SCRIPT, path, str(2 * timeout_s + 1)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PDSERVE_TP_TIMEOUT_S": str(timeout_s)})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.rpartition("RESULT ")[2])
    assert out["first"] == out["want"]
    assert out["alive_after_idle"] == [True, True]
    assert out["after_idle"] == out["want"]
    assert re.fullmatch(r"tensor-parallel rank 1 of 3 \(pid \d+\) is stopped and did not answer within "
                        r"PDSERVE_TP_TIMEOUT_S \(4 s\); the engine cannot continue without it", out["stopped"])
    assert out["stopped_s"] < timeout_s + 30  # the collective's bound, not a hang
    assert out["closed"][0] == -signal.SIGKILL  # close() does not leave the stopped rank behind
