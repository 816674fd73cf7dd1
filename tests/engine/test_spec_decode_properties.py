"""Property test (hypothesis), scheduler and KV cache manager without a model, with speculation: whatever
the drafts, budgets, pool sizes, preemption modes and aborts, no block leaks, reference counts equal the
holders, and the prefix cache only ever holds hashes of verified tokens (never a rejected draft's)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_pool_properties import BLOCK, check_invariants

from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import Request, RequestStatus
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.engine.swap import SwapManager


def target_token(position: int, seed: int) -> int:
    """The 'model': the token it emits at each position (drafts that differ are rejected)."""
    return (position * 7 + seed) % 5


def verified_hashes(request: Request) -> set:
    return set(compute_block_hashes(request.all_token_ids, BLOCK, request.cache_salt, []))


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 14), st.integers(0, 2)),
        st.tuples(st.just("step"), st.lists(st.integers(0, 5), max_size=5)),  # drafts (tokens 0..4 can be right)
        st.tuples(st.just("abort"), st.integers(0, 1000)),
    ),
    max_size=50,
)


def _verify(sched: Scheduler, kv: KVCacheManager, request: Request, n: int, legit: set) -> bool:
    """Accept drafts that match the target, append the accepted ones and one more; roll back. Returns finished."""
    draft = request.spec_token_ids
    first = request.num_tokens
    emitted = []
    for j, d in enumerate(draft):
        if d != target_token(first + j, 1):
            break
        emitted.append(d)
    emitted.append(target_token(first + len(emitted), 1))
    request.spec_token_ids = []
    for t in emitted:
        request.append_output_token(t)
        legit |= verified_hashes(request)
        if request.num_output_tokens >= request.max_tokens:
            sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
            return True
    request.num_computed_tokens = request.num_tokens - 1
    kv.trim(request, request.num_computed_tokens)
    return False


@settings(max_examples=120, deadline=None)
@given(ops=ops, num_blocks=st.integers(10, 30), budget=st.sampled_from([3, 8, 16]),
       mode=st.sampled_from(["recompute", "swap"]))
def test_speculation_leaks_no_block_and_hashes_no_rejected_token(ops, num_blocks, budget, mode):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=True)
    swap = SwapManager(kv, 16) if mode == "swap" else None
    max_len = (num_blocks - 1) * BLOCK
    sched = Scheduler(kv, max_num_seqs=5, max_num_batched_tokens=budget, max_model_len=max_len,
                      preemption_mode=mode, swap_manager=swap)
    live: dict[str, Request] = {}
    legit: set = set()
    for i, op in enumerate(ops):
        if op[0] == "add":
            _, plen, max_tokens, prefix = op
            if plen + max_tokens + 6 > max_len:
                continue
            prompt = [prefix] * min(plen, 6) + [target_token(p, 1) for p in range(6, plen)]
            req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset())
            live[req.request_id] = req
            legit |= verified_hashes(req)
            sched.add_request(req)
        elif op[0] == "step":
            for r in sched.running:  # the proposer's turn: drafts for decoding requests only
                r.spec_token_ids = list(op[1]) if r.num_computed_tokens == r.num_tokens - 1 else []
            out = sched.schedule()
            assert out.num_scheduled_tokens <= budget
            for request, n in out.scheduled:
                assert request.num_computed_tokens + n <= request.num_tokens + len(out.spec_token_ids.get(
                    request.request_id, ()))
            for request in sched.update_after_step(out):
                if out.spec_token_ids.get(request.request_id):
                    done = _verify(sched, kv, request, 0, legit)
                else:
                    request.append_output_token(target_token(request.num_tokens, 1))
                    legit |= verified_hashes(request)
                    done = request.num_output_tokens >= request.max_tokens
                    if done:
                        sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
                if done:
                    live.pop(request.request_id)
        elif op[0] == "abort" and live:
            victim = sorted(live)[op[1] % len(live)]
            sched.finish_request(live.pop(victim), RequestStatus.FINISHED_ABORTED)
        check_invariants(kv, sched)
        assert set(kv.block_pool.cached_block_hash_to_block) <= legit
        for r in sched.running:  # rejected drafts' blocks were given back
            assert len(kv.req_to_blocks.get(r.request_id, ())) == -(-r.num_computed_tokens // BLOCK)
    for request in list(live.values()):
        sched.finish_request(request, RequestStatus.FINISHED_ABORTED)
    check_invariants(kv, sched)
    assert kv.block_pool.get_num_free_blocks() == num_blocks - 1
    assert not kv.req_to_blocks
