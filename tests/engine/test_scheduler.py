"""``Scheduler`` on its own (no model): one token budget per step (running requests first, then chunked
prefills), ``max_num_seqs``, preemption order by policy, prefix-cache hits at admission, and release of
everything a finished request holds. The waiting queues of both policies behind one interface."""

from __future__ import annotations

import pytest

from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import ConstantList, Request, RequestStatus
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.engine.scheduler import FCFSQueue, PriorityQueue, Scheduler, create_waiting_queue

BLOCK = 4


def req(rid: str, tokens: list[int], max_tokens: int = 8, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset(),
                   arrival_time=arrival, priority=priority)


def make(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8, policy: str = "fcfs",
         caching: bool = True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK, caching), max_num_seqs, budget, 1024, policy)


def step(sched: Scheduler, token: int = 1) -> list[tuple[str, int]]:
    """One step; every request that completes its tokens samples ``token``. Returns what was scheduled."""
    out = sched.schedule()
    for request in sched.update_after_step(out):
        request.append_output_token(token)
    return [(r.request_id, n) for r, n in out.scheduled]


def test_one_budget_covers_decodes_first_then_prefill_chunks():
    sched = make(budget=16)
    for i in range(3):
        sched.add_request(req(f"r{i}", list(range(10 * i, 10 * i + 10))))
    assert step(sched) == [("r0", 10), ("r1", 6)]  # r1 chunked, r2 waits
    assert step(sched) == [("r0", 1), ("r1", 4), ("r2", 10)]  # the decode first, then the rest of r1
    assert sched.num_waiting == 0 and [r.request_id for r in sched.running] == ["r0", "r1", "r2"]


def test_a_chunked_prefill_samples_only_after_its_last_chunk():
    sched = make(budget=16)
    r = req("long", list(range(40)))
    sched.add_request(r)
    sampled = []
    for _ in range(3):
        out = sched.schedule()
        sampled.append(([n for _, n in out.scheduled], [x.request_id for x in sched.update_after_step(out)]))
    assert sampled == [([16], []), ([16], []), ([8], ["long"])]
    assert r.num_computed_tokens == 40


def test_max_num_seqs_caps_the_batch():
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", [i] * 4))
    assert [rid for rid, _ in step(sched)] == ["r0", "r1"]
    assert sched.num_waiting == 1


def _three_one_block_requests(policy: str, priorities=(0, 0, 0), caching: bool = False):
    # 4 usable blocks; three 4-token prompts fill one block each, and each needs a second for its next token
    sched = make(num_blocks=5, budget=64, policy=policy, caching=caching)
    reqs = [req(f"r{i}", [10 * i + j for j in range(4)], priority=p, arrival=float(i))
            for i, p in enumerate(priorities)]
    for r in reqs:
        sched.add_request(r)
    assert sorted(step(sched)) == [("r0", 4), ("r1", 4), ("r2", 4)]
    return sched, reqs


def test_fcfs_preempts_the_latest_arrival_by_recompute_and_puts_it_first_in_line():
    sched, (r0, r1, r2) = _three_one_block_requests("fcfs")
    sched.add_request(req("late", [7] * 4, arrival=9.0))
    out = sched.schedule()
    assert out.preempted == [r2] and [(r.request_id, n) for r, n in out.scheduled] == [("r0", 1), ("r1", 1)]
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.num_tokens_to_recompute == 4 and sched.kv.get_block_ids("r2") == []
    assert list(sched.waiting) == [r2, sched.requests["late"]]  # nothing admitted on a step that preempted
    assert sched.num_preemptions == 1


def test_priority_preempts_the_largest_priority_value_not_yet_scheduled():
    sched, (r0, r1, r2) = _three_one_block_requests("priority", priorities=(0, 5, 1))
    assert [r.request_id for r in sched.running] == ["r0", "r2", "r1"]  # admitted by rank
    out = sched.schedule()
    assert out.preempted == [r1]  # r2 asked for a block; r1 is the worst: it yields, r2 gets the block
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 1), ("r2", 1)]


def test_admission_takes_prefix_cache_hits_and_records_them():
    sched = make(budget=64)
    a = req("a", list(range(10)))
    sched.add_request(a)
    step(sched)
    b = req("b", list(range(8)) + [50, 51, 52])
    sched.add_request(b)
    assert step(sched) == [("a", 1), ("b", 3)]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 11
    pcs = sched.kv.prefix_cache_stats
    assert (pcs.queries, pcs.hits) == (10 + 11, 8)


def test_a_recomputed_request_is_looked_up_as_preempted_never_as_new():
    sched, (r0, r1, r2) = _three_one_block_requests("fcfs", caching=True)
    step(sched)  # r2 preempted; r1 takes its freed block (evicting r2's cached hash)
    sched.finish_request(r0, RequestStatus.FINISHED_STOPPED)
    assert ("r2", 5) in step(sched)  # prompt + its first token, recomputed
    pcs = sched.kv.prefix_cache_stats
    assert (pcs.queries, pcs.hits, pcs.preempted_queries, pcs.preempted_hits) == (12, 0, 5, 0)
    assert r2.num_cached_tokens == 0 and r2.num_preemptions == 1


def test_finishing_releases_blocks_and_queue_slots_wherever_the_request_is():
    sched = make(num_blocks=9, budget=8)
    running, waiting = req("run", list(range(8))), req("wait", list(range(20, 28)))
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    assert sched.kv.num_used_blocks == 2 and sched.num_waiting == 1  # the budget went to run's prompt
    sched.finish_request(running, RequestStatus.FINISHED_ABORTED)
    sched.finish_request(waiting, RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_used_blocks == 0 and not sched.has_unfinished_requests() and not sched.requests
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED


def test_a_detached_request_keeps_its_blocks_outside_the_batch():
    sched = make()
    r = req("p", list(range(6)))
    sched.add_request(r)
    step(sched)
    sched.detach(r)
    assert not sched.running and "p" not in sched.requests and sched.kv.num_held_blocks("p") == 2


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_queues_iterate_in_pop_order(policy):
    q = create_waiting_queue(policy)
    assert isinstance(q, FCFSQueue if policy == "fcfs" else PriorityQueue)
    a, b, c = req("a", [1], priority=2, arrival=0.0), req("b", [1], priority=1, arrival=1.0), req("c", [1], arrival=2.0)
    for r in (a, b, c):
        q.add(r)
    want = [a, b, c] if policy == "fcfs" else [c, b, a]
    assert list(q) == want and q.peek() is want[0] and len(q) == 3
    q.remove(b)
    preempted = req("x", [1], priority=3, arrival=3.0)
    q.add_front(preempted)  # FCFS: back to the front; priority: by its own rank (last here)
    want = [preempted, a, c] if policy == "fcfs" else [c, a, preempted]
    assert list(q) == want
    assert [q.pop() for _ in range(3)] == want and len(q) == 0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        create_waiting_queue("lifo")


def test_output_token_ids_is_a_read_only_view_not_a_copy():
    r = req("r", [1, 2, 3])
    view = r.output_token_ids
    r.append_output_token(7)
    assert isinstance(view, ConstantList) and view == [7] and list(view) == [7] and view[-1] == 7
    assert r.all_token_ids == [1, 2, 3, 7] and r.num_output_tokens == 1
    with pytest.raises(TypeError):
        view[0] = 1  # type: ignore[index]
    assert not hasattr(view, "append")
    resumed = Request("s", [1], SamplingParams(), 8, frozenset(), output_token_ids=[4, 5])
    assert resumed.output_token_ids == [4, 5] and resumed.all_token_ids == [1, 4, 5]


def srpt_order(requests: list[Request], aging: float) -> list[str]:
    q = create_waiting_queue("srpt", aging)
    for r in requests:
        q.add(r)
    return [r.request_id for r in q]


def test_srpt_takes_the_shortest_remaining_prefill_aged_by_the_time_waited():
    # ranks at any moment: remaining - 200 x waited; an old short prompt, then the short ones that came just after the
    # long one (within (48 - 16) / 200 = 0.16 s), the long one, and a short one that came too late to overtake it
    old, long_, s1, s2, late = (req("old", list(range(100, 116)), arrival=9.0), req("long", list(range(48)), arrival=10.0),
                                req("s1", list(range(200, 216)), arrival=10.1),
                                req("s2", list(range(300, 316)), arrival=10.15),
                                req("late", list(range(400, 416)), arrival=10.2))
    mixed = [late, s2, long_, old, s1]
    assert srpt_order(mixed, 200.0) == ["old", "s1", "s2", "long", "late"]
    assert srpt_order(mixed, 0.0) == ["late", "s2", "old", "s1", "long"]  # no aging: shortest, ties as admitted
    assert srpt_order(mixed, 1e6) == ["old", "long", "s1", "s2", "late"]  # strong aging: arrival order (FIFO)


def test_srpt_starvation_bound_an_s_token_prompt_is_overtaken_only_by_arrivals_within_s_minus_1_over_a():
    """The bound in ``SRPTQueue``'s docstring, checked on every arrival offset around it: a 1-token prompt that came
    d seconds after an S-token one goes first exactly when d < (S - 1) / A."""
    aging = 200.0
    for size in (2, 17, 201, 1024):
        bound = (size - 1) / aging
        for d in (0.0, bound * 0.5, bound - 1e-3, bound + 1e-3, bound * 2):
            big, one = req("big", list(range(size)), arrival=50.0), req("one", [7], arrival=50.0 + d)
            first = srpt_order([one, big], aging)[0]
            assert first == ("one" if d < bound else "big"), (size, d, bound)


def test_srpt_scheduler_prefills_in_aged_order_and_a_client_priority_still_comes_first():
    sched = make(budget=16, max_num_seqs=1, policy="srpt")
    sched.waiting = create_waiting_queue("srpt", 200.0)
    sched.add_request(req("long", list(range(48)), max_tokens=1, arrival=10.0))
    sched.add_request(req("short", list(range(100, 116)), max_tokens=1, arrival=10.1))
    sched.add_request(req("urgent", list(range(200, 232)), max_tokens=1, arrival=11.0, priority=-1))
    order = []
    for _ in range(8):
        order += [rid for rid, _ in step(sched) if rid not in order]
        for r in list(sched.running):
            if r.num_output_tokens:
                sched.detach(r)
    assert order == ["urgent", "short", "long"]


def make_long(threshold: int, max_long: int = 1, budget: int = 64, policy: str = "fcfs") -> Scheduler:
    return Scheduler(KVCacheManager(128, BLOCK, True), 8, budget, 1024, policy,
                     long_prefill_token_threshold=threshold, max_long_partial_prefills=max_long)


def test_long_prefill_threshold_chunks_a_long_prompt_and_lets_short_ones_pass_it():
    # vLLM's long_prefill_token_threshold / max_long_partial_prefills: one long prompt at a time, T tokens a step
    sched = make_long(threshold=8)
    sched.add_request(req("long1", list(range(30))))
    sched.add_request(req("long2", list(range(100, 130))))
    sched.add_request(req("short", list(range(200, 206))))
    # long2 waits (one long prefill at a time) and the short prompt behind it starts now
    assert step(sched) == [("long1", 8), ("short", 6)]
    assert step(sched) == [("long1", 8), ("short", 1)]
    assert step(sched) == [("long1", 8), ("short", 1)]
    # long1's last 6 tokens still count as its long prefill (a step holds at most T tokens of long prompts): long2
    # starts once long1 is done
    assert step(sched) == [("long1", 6), ("short", 1)]
    assert step(sched) == [("long1", 1), ("short", 1), ("long2", 8)]


def test_without_a_threshold_the_long_prompt_takes_the_budget_first():
    sched = make_long(threshold=0)
    sched.add_request(req("long1", list(range(30))))
    sched.add_request(req("long2", list(range(100, 130))))
    sched.add_request(req("short", list(range(200, 206))))
    assert step(sched) == [("long1", 30), ("long2", 30), ("short", 4)]


def test_two_long_partial_prefills_when_allowed_and_a_cached_prefix_makes_a_prompt_short():
    sched = make_long(threshold=8, max_long=2)
    sched.add_request(req("a", list(range(20))))
    sched.add_request(req("b", list(range(100, 120))))
    sched.add_request(req("c", list(range(300, 320))))
    assert step(sched) == [("a", 8), ("b", 8)]  # c waits: two long ones run
    sched = make_long(threshold=8)
    first = req("first", list(range(24)))
    sched.add_request(first)
    while not first.output_token_ids:
        step(sched)
    sched.finish_request(first, RequestStatus.FINISHED_STOPPED)  # its 6 full blocks stay in the prefix cache
    sched.add_request(req("long", list(range(500, 540))))
    sched.add_request(req("again", list(range(24)) + [7, 7, 7]))  # 24 tokens cached, 3 left: not long
    assert step(sched) == [("long", 8), ("again", 3)]


def test_threshold_and_cap_are_checked():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_long(threshold=-1)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        make_long(threshold=8, max_long=0)


def make_srpt_long(threshold: int = 8, max_num_seqs: int = 8, aging: float = 200.0) -> Scheduler:
    return Scheduler(KVCacheManager(128, BLOCK, True), max_num_seqs, 64, 1024, "srpt", aging_tokens_per_s=aging,
                     long_prefill_token_threshold=threshold)


def prefill_step(sched: Scheduler) -> list[tuple[str, int]]:
    """``step`` as on a prefill pod: a request leaves the batch with its first token (detached for its hand-over)."""
    scheduled = step(sched)
    for r in list(sched.running):
        if r.num_output_tokens:
            sched.detach(r)
    return scheduled


def test_srpt_a_long_prefill_in_progress_sits_out_the_step_of_a_shorter_waiting_prompt():
    # The step is what a newly queued prompt waits for: with the long prompt's 8-token chunk beside it, the short
    # prompt's first token would wait for that chunk too. The short one goes alone, then the long one goes on where
    # it was, however long ago it arrived (no aging here: it has the bound of the next test instead).
    sched = make_srpt_long()
    long_ = req("long", list(range(32)), arrival=10.0)
    sched.add_request(long_)
    assert prefill_step(sched) == [("long", 8)]
    sched.add_request(req("short", list(range(200, 206)), arrival=99.0))
    assert prefill_step(sched) == [("short", 6)]
    assert long_.num_computed_tokens == 8 and long_.status == RequestStatus.RUNNING  # its blocks stay
    assert prefill_step(sched) == [("long", 8)]
    assert prefill_step(sched) == [("long", 8)]
    # its last chunk (8 tokens, not more than T) is still its long prefill: it sits out for a 6-token prompt
    sched.add_request(req("last", list(range(300, 306)), arrival=99.5))
    assert prefill_step(sched) == [("last", 6)]
    assert prefill_step(sched) == [("long", 8)] and long_.output_token_ids == [1]
    # a prompt with as many tokens left as the long one does not pass it
    sched = make_srpt_long()
    sched.add_request(req("long", list(range(32)), arrival=10.0))
    prefill_step(sched)
    sched.add_request(req("eight", list(range(400, 408)), arrival=10.1))
    sched.add_request(req("same", list(range(500, 524)), arrival=10.1))  # long itself: waits (one long at a time)
    assert prefill_step(sched) == [("eight", 8)]  # 8 < 24 left


def test_srpt_a_long_prefill_never_sits_out_two_steps_in_a_row():
    # Starvation bound: a long prefill with c chunks left finishes within 2c steps, whatever arrives.
    sched = make_srpt_long()
    long_ = req("long", list(range(32)), arrival=10.0)
    sched.add_request(long_)
    steps = [prefill_step(sched)]
    for i in range(12):  # a short prompt arrives before every step
        sched.add_request(req(f"s{i}", list(range(100 * i + 100, 100 * i + 104)), arrival=11.0 + i))
        steps.append(prefill_step(sched))
        if long_.output_token_ids:
            break
    assert steps == [[("long", 8)], [("s0", 4)], [("long", 8), ("s1", 4)], [("s2", 4)], [("long", 8), ("s3", 4)],
                     [("s4", 4)], [("long", 8), ("s5", 4)]]
    assert long_.output_token_ids == [1] and len(steps) <= 2 * 4


def test_a_long_prefill_yields_only_to_a_prompt_that_starts_and_not_under_fcfs_or_without_a_threshold():
    # the short prompt cannot start (max_num_seqs is full with the long one): the long one runs, never an empty step
    sched = make_srpt_long(max_num_seqs=1)
    sched.add_request(req("long", list(range(32)), arrival=10.0))
    prefill_step(sched)
    sched.add_request(req("short", list(range(200, 206)), arrival=10.0001))
    assert prefill_step(sched) == [("long", 8)]
    # fcfs keeps the long prompt's turn (decode and colocated pods: no threshold, nothing changes either)
    for policy, threshold, first in (("fcfs", 8, [("long", 8)]), ("srpt", 0, [("long", 32)])):
        sched = Scheduler(KVCacheManager(128, BLOCK, True), 8, 64, 1024, policy,
                          long_prefill_token_threshold=threshold)
        sched.add_request(req("long", list(range(32)), arrival=10.0))
        assert prefill_step(sched) == first
        sched.add_request(req("short", list(range(200, 206)), arrival=10.0001))
        assert prefill_step(sched) == ([("long", 8), ("short", 6)] if threshold else [("short", 6)])


def test_srpt_a_long_prompt_does_not_start_beside_a_shorter_one_two_steps_in_a_row():
    # both waiting when the step begins (a long prompt right behind a short one): the short one goes alone
    sched = make_srpt_long()
    sched.add_request(req("long", list(range(32)), arrival=10.0))
    sched.add_request(req("short", list(range(200, 206)), arrival=10.0))
    assert prefill_step(sched) == [("short", 6)]
    # ... but not twice in a row: the next short prompt shares the long one's first chunk
    sched.add_request(req("next", list(range(300, 306)), arrival=11.0))
    assert prefill_step(sched) == [("long", 8), ("next", 6)]  # aged order: the long one arrived 1 s earlier
    # fcfs: unchanged
    sched = Scheduler(KVCacheManager(128, BLOCK, True), 8, 64, 1024, "fcfs", long_prefill_token_threshold=8)
    sched.add_request(req("short", list(range(200, 206)), arrival=10.0))
    sched.add_request(req("long", list(range(32)), arrival=10.0))
    assert prefill_step(sched) == [("short", 6), ("long", 8)]
