"""Property tests (hypothesis) on the block pool, KV cache manager and scheduler, without a model:
after any mix of adds, steps (with sampled tokens) and aborts, reference counts equal the
number of holders, no count is negative, no block is both free and held, and once every request is
gone every block is back in the free queue."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import Request, RequestStatus
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.engine.swap import SwapManager
from pdserve.shared.protocol.sampling_params import SamplingParams

BLOCK = 4


def check_invariants(kv: KVCacheManager, sched: Scheduler) -> None:
    pool = kv.block_pool
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    for block in pool.blocks[1:]:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        assert (block in pool.free_block_queue) == (block.ref_cnt == 0)
    for h, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == h
    # only running requests and pending reservations hold device blocks
    running = {r.request_id for r in sched.running}
    assert set(kv.req_to_blocks) <= running
    for r in sched.running:
        assert len(kv.req_to_blocks.get(r.request_id, ())) * BLOCK >= r.num_computed_tokens


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 2)),
        st.tuples(st.just("step"), st.integers(0, 1000)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(12, 40), budget=st.sampled_from([4, 16, 64]),
       mode=st.sampled_from(["recompute", "swap"]), policy=st.sampled_from(["fcfs", "priority"]),
       caching=st.booleans())
def test_no_block_leaks_or_negative_refcounts(ops, num_blocks, budget, mode, policy, caching):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
    swap = SwapManager(kv, 16) if mode == "swap" else None
    max_len = (num_blocks - 1) * BLOCK
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=max_len, policy=policy,
                      preemption_mode=mode, swap_manager=swap)
    live: dict[str, Request] = {}
    counter = 0
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prefix_id, priority = op
            prompt = [prefix_id] * min(plen, 8) + list(range(100 + counter, 100 + counter + max(0, plen - 8)))
            if plen + max_tokens > max_len:
                continue
            req = Request(f"r{counter}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset(),
                          arrival_time=float(counter), priority=priority)
            counter += 1
            live[req.request_id] = req
            sched.add_request(req)
        elif op[0] == "step":
            out = sched.schedule()
            assert out.num_scheduled_tokens <= budget
            assert len(out.scheduled) <= 6
            for request, n in out.scheduled:
                assert request.num_computed_tokens + n <= request.num_tokens
            for request in sched.update_after_step(out):
                request.append_output_token(op[1] + request.num_output_tokens)
                if request.num_output_tokens >= request.max_tokens:
                    sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
                    live.pop(request.request_id)
        elif op[0] == "abort" and live:
            victim = sorted(live)[op[1] % len(live)]
            sched.finish_request(live.pop(victim), RequestStatus.FINISHED_ABORTED)
        check_invariants(kv, sched)
    for request in list(live.values()):
        sched.finish_request(request, RequestStatus.FINISHED_ABORTED)
    check_invariants(kv, sched)
    assert kv.block_pool.get_num_free_blocks() == num_blocks - 1
    assert not kv.req_to_blocks
    if swap is not None:
        assert swap.num_used_cpu_blocks == 0


def test_every_request_finishes_when_run_to_completion():
    """Progress: with blocks for only ~2 requests at once, 10 requests still all finish (preemption)."""
    kv = KVCacheManager(10, BLOCK)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=36)
    reqs = [Request(f"r{i}", list(range(i, i + 10)), SamplingParams(max_tokens=8), 8, frozenset()) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for request in sched.update_after_step(out):
            request.append_output_token(1)
            if request.num_output_tokens >= request.max_tokens:
                sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sched.num_preemptions > 0
