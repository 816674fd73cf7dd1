"""Iteration-level scheduler (continuous batching) with one token budget per step.

The rule is vLLM v1's: every request's ``num_computed_tokens`` catches up with its ``num_tokens``;
a step gives each running request (decodes first) and then waiting requests (prefills, in chunks
when the budget is short) as many tokens as the budget ``max_num_batched_tokens`` allows, up to
``max_num_seqs`` requests. When blocks run out, the scheduler preempts a victim chosen by policy
(``fcfs``: the latest arrival; ``priority``: the largest ``(priority, arrival_time)``) by recompute
(free its blocks; it rejoins the front of the queue) or by swap (copy its blocks to the CPU pool).
``srpt`` orders the waiting queue by shortest remaining prefill with aging (``SRPTQueue``: prefill pods).

Long prompts (vLLM's ``long_prefill_token_threshold`` and ``max_long_partial_prefills``): with a threshold T > 0, a
request gets at most T new tokens per step, and at most ``max_long_partial_prefills`` requests with more than T
prompt tokens still to compute are in prefill at once; a long waiting prompt beyond that keeps its place while
shorter ones behind it start. A step then holds at most T tokens of each long prompt, so a short prompt that
arrives behind a long one waits one such step, not the long prompt's whole prefill (a prefill pod's step has no
decodes to protect; its length is what a newly queued prompt waits). A long prompt counts as long until its prefill
is done. Under ``srpt`` a long prefill in progress also sits out a step for a waiting prompt with fewer tokens left,
never two steps in a row (``_yielding_long_prefills``).

Speculative decoding is the same rule: a decoding request with k draft tokens asks for k + 1 slots (the
budget counts the drafts; a short budget or a short pool trims them first); the engine rolls
``num_computed_tokens`` and the emptied blocks back after verification.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import Request, RequestStatus
from pdserve.shared.engine.swap import SwapManager


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs: per request, how many of its tokens to compute, in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts scheduled for verification

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue(ABC):
    """Requests waiting for their first schedule (or to resume after a preemption), in admission order."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In the order ``pop`` would return them."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_front(self, request: Request) -> None:
        """A preempted request goes back ahead of the ones it was admitted before."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...


class FCFSQueue(WaitingQueue):
    """First come, first served; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_front(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)


class PriorityQueue(WaitingQueue):
    """A heap on ``(priority, arrival_time)``, lower first (vLLM's convention), ties in admission order; a
    preempted request goes back by its own rank."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def add_front(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)


class SRPTQueue(WaitingQueue):
    """Shortest remaining prefill first, with aging: a request's rank is ``remaining prompt tokens - A x seconds
    waited`` (``A`` = ``aging_tokens_per_s``), lower first, after the request's own ``priority``.

    Every waiting request ages at the same rate, so the order between two of them never changes while they wait:
    ``remaining - A (now - arrival)`` ranks as the fixed key ``remaining + A x arrival``, and a heap on it stays
    valid. Starvation bound: a request with S tokens to prefill that arrived at t is overtaken only by requests
    that arrived before t + (S - 1) / A (a later one has a key of at least 1 + A x (t + (S - 1) / A) > S + A t);
    so it waits at most (S - 1) / A seconds longer than under FIFO, plus the work of those that arrived in that
    window and overtook it. A = 0 is plain shortest-first (no bound); a large A approaches FCFS.
    Remaining tokens are counted when the request joins (prompt and resumed output, less tokens computed).
    The rule is shortest-remaining-processing-time (Schrage, 1968) with linear aging as in Linux's and
    SGLang's schedulers' fairness terms; arrival times are the requests' own (a queue entry's router time
    counts its wait in Redis as well)."""

    def __init__(self, aging_tokens_per_s: float) -> None:
        assert aging_tokens_per_s >= 0
        self.aging = aging_tokens_per_s
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def key(self, request: Request) -> float:
        """The fixed rank of ``request``: remaining prompt tokens + A x arrival time (lower first)."""
        return (request.num_tokens - request.num_computed_tokens) + self.aging * request.arrival_time

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, self.key(request), next(self._counter), request))

    def add_front(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)


def create_waiting_queue(policy: str, aging_tokens_per_s: float = 200.0) -> WaitingQueue:
    """``fcfs``, ``priority`` or ``srpt`` (aged at ``aging_tokens_per_s``); raises ``ValueError`` otherwise."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "srpt":
        return SRPTQueue(aging_tokens_per_s)
    raise ValueError(f"unknown scheduling policy {policy!r}: fcfs, priority or srpt")


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        preemption_mode: str = "recompute",
        swap_manager: SwapManager | None = None,
        aging_tokens_per_s: float = 200.0,
        long_prefill_token_threshold: int = 0,
        max_long_partial_prefills: int = 1,
    ) -> None:
        if long_prefill_token_threshold < 0 or max_long_partial_prefills < 1:
            raise ValueError("long_prefill_token_threshold must be >= 0 and max_long_partial_prefills >= 1, got "
                             f"{long_prefill_token_threshold} and {max_long_partial_prefills}")
        self.kv = kv_cache_manager
        self._long_prefills = 0  # running requests in a long prefill (this step)
        self._sat_out: set[str] = set()  # ids of the long prefills that sit out this step (``_yielding_long_prefills``)
        self._sat_out_last: set[str] = set()  # ... and the last step
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_long_partial_prefills = max_long_partial_prefills
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.preemption_mode = preemption_mode
        self.swap = swap_manager
        self.waiting = create_waiting_queue(policy, aging_tokens_per_s)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_blocks_swapped_out = 0  # device -> CPU block copies, ever
        self.num_blocks_swapped_in = 0

    @property
    def num_swapped(self) -> int:
        """Requests whose KV sits in the CPU swap pool now (vLLM v0's ``num_requests_swapped``)."""
        return sum(1 for r in self.waiting if r.status == RequestStatus.SWAPPED)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def add_running(self, request: Request) -> None:
        """A request whose blocks are already allocated (its KV received over the wire) joins the batch."""
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def detach(self, request: Request) -> None:
        """A running request leaves the batch but keeps its blocks (a prefill-only request, parked for export)."""
        self.running.remove(request)
        self.requests.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.reap_loads()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        # a long prompt counts until its prefill is done, its last chunk too: a step holds at most T long tokens
        self._long_prefills = sum(1 for r in self.running if self._is_long(r) or self._in_long_prefill(r))

        # running requests (decodes and unfinished prefill chunks) first, but a long prefill that a shorter waiting
        # prompt outranks sits this step out (``_yielding_long_prefills``), unless nothing waiting can start
        yielding = self._yielding_long_prefills()
        budget = self._schedule_running([r for r in self.running if r not in yielding], budget, out, scheduled_ids)
        num_scheduled = len(out.scheduled)
        self._schedule_waiting(out, budget, scheduled_ids)
        if yielding and len(out.scheduled) == num_scheduled:  # no waiting prompt could start (blocks, seqs, loading)
            self._schedule_running(yielding, budget, out, scheduled_ids)
        return out

    def _schedule_running(self, requests: list[Request], budget: int, out: SchedulerOutput,
                          scheduled_ids: set[str]) -> int:
        """Schedule ``requests`` (running ones, in this order) within ``budget``, preempting victims when blocks run
        out; returns the budget left."""
        for request in requests:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING or request not in self.running:
                continue  # preempted for an earlier one this step
            self.kv.free_out_of_window(request)  # a sliding-window model: blocks no query reads again
            num_new = self._num_new_running(request, budget)
            if num_new <= 0:
                continue
            while not self.kv.can_allocate(request, num_new):
                victim = self._pick_victim(exclude=scheduled_ids)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                self.kv.allocate_slots(request, num_new)
                if request.spec_token_ids:
                    out.spec_token_ids[request.request_id] = request.spec_token_ids
                out.scheduled.append((request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
        return budget

    def _yielding_long_prefills(self) -> list[Request]:
        """Running long prefills that sit this step out (``srpt`` with a threshold only): those with more tokens left
        than the first waiting prompt that is not long (shortest remaining first, after ``priority``). Such a prompt
        would otherwise share the step with the long one's T-token chunk and wait for it: the step is what its TTFT
        waits for, and on a CPU core T long tokens take several times a short prompt's own step. Their blocks stay
        allocated. A long prefill never sits out two steps in a row (``_sat_out``), so one with ``c`` chunks left
        finishes within ``2c`` steps however many short prompts arrive."""
        queue, sat_out, self._sat_out = self.waiting, self._sat_out, set()
        self._sat_out_last = sat_out  # for a long prompt about to start (``_starts_later``)
        if self.long_prefill_token_threshold <= 0 or not isinstance(queue, SRPTQueue) or not len(queue):
            return []
        longs = [r for r in self.running if self._in_long_prefill(r) and r.request_id not in sat_out]
        if not longs:
            return []
        first = next((r for r in queue if not self._is_long(r)), None)  # the best-ranked waiting prompt that can start
        if first is None:
            return []
        rank = (first.priority, first.num_tokens - first.num_computed_tokens)
        yielding = [r for r in longs if rank < (r.priority, r.num_tokens - r.num_computed_tokens)]
        self._sat_out.update(r.request_id for r in yielding)
        return yielding

    def _starts_later(self, request: Request, num_computed: int, short_started: bool) -> bool:
        """Whether a long waiting ``request`` waits a step because a shorter prompt starts in this one (``srpt`` with a
        threshold): the same rule as for a long prefill in progress (``_yielding_long_prefills``), never two steps in a
        row."""
        if (not short_started or not isinstance(self.waiting, SRPTQueue) or not self._is_long(request, num_computed)
                or request.request_id in self._sat_out_last):
            return False
        self._sat_out.add(request.request_id)
        return True

    def _in_long_prefill(self, request: Request) -> bool:
        """Whether a running ``request`` is in a chunked prefill that started long (more than the threshold to
        compute after its prefix hit), up to and including its last chunk."""
        threshold = self.long_prefill_token_threshold
        return (0 < threshold and request.num_computed_tokens < request.num_prompt_tokens
                and request.num_prompt_tokens - max(request.num_cached_tokens, 0) > threshold)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, scheduled_ids: set[str]) -> None:
        """Waiting requests (new prefills, recomputes, swap-ins), only when nothing was preempted. One whose prefix
        blocks are loading from an offloading tier, or a long one while the long prefills are at their cap, is
        skipped this step and keeps its place in the queue."""
        loading: list[Request] = []  # skipped this step, back in place afterwards (blocks loading, or long)
        short_started = False  # a prompt that is not long starts in this step
        while not out.preempted and len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.status != RequestStatus.SWAPPED and self.kv.is_loading(request):
                loading.append(self.waiting.pop())
                continue
            if request.status == RequestStatus.SWAPPED:
                if self._long_blocked(request, request.num_computed_tokens):
                    loading.append(self.waiting.pop())
                    continue
                num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
                if not self._swap_in(request, num_new, out):
                    break
                allocated = self.kv.allocate_slots(request, num_new)  # the swapped-in blocks cover all but new slots
                assert allocated is not None, "swap-in checked the blocks it needs"
            else:
                computed, num_computed = self.kv.get_computed_blocks(request)
                if self._long_blocked(request, num_computed) or self._starts_later(request, num_computed, short_started):
                    loading.append(self.waiting.pop())
                    continue
                num_new = self._chunk(request.num_tokens - num_computed, budget)
                if self.kv.allocate_slots(request, num_new, computed) is None:
                    break
                self.kv.record_prefix_cache_stats(request, num_computed,
                                                  "preempted" if request.num_preemptions else "new")
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed
                request.num_computed_tokens = num_computed
            self.waiting.pop()
            if self._is_long(request):
                self._long_prefills += 1
            elif request.num_computed_tokens < request.num_prompt_tokens:
                short_started = True
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            scheduled_ids.add(request.request_id)
            budget -= num_new
        for request in reversed(loading):
            self.waiting.add_front(request)

    def _is_long(self, request: Request, num_computed: int | None = None) -> bool:
        """Whether ``request`` has more than ``long_prefill_token_threshold`` (> 0) tokens still to compute."""
        threshold = self.long_prefill_token_threshold
        done = request.num_computed_tokens if num_computed is None else num_computed
        return 0 < threshold < request.num_tokens - done

    def _long_blocked(self, request: Request, num_computed: int) -> bool:
        """A long waiting prompt while ``max_long_partial_prefills`` long ones are in prefill: it waits this step."""
        return self._is_long(request, num_computed) and self._long_prefills >= self.max_long_partial_prefills

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens one request computes this step: its ``remaining`` ones, within the budget and the threshold."""
        threshold = self.long_prefill_token_threshold
        return min(remaining, budget, threshold) if threshold > 0 else min(remaining, budget)

    def _num_new_running(self, request: Request, budget: int) -> int:
        """Tokens a running request asks for: its uncomputed tokens, plus its drafts when decoding; drafts
        the budget or the free blocks cannot hold are dropped (before anyone is preempted for them)."""
        num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
        spec = request.spec_token_ids
        if spec:
            del spec[max(0, budget - num_new):]
            if spec and not self.kv.can_allocate(request, num_new + len(spec)):
                spec.clear()
            num_new += len(spec)
        return num_new

    def _pick_victim(self, exclude: set[str]) -> Request:
        # never a request already scheduled this step; the one asking for blocks is always a candidate
        candidates = [r for r in self.running if r.request_id not in exclude]
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        self.num_preemptions += 1
        request.num_preemptions += 1
        if self.preemption_mode == "swap" and self.swap is not None and self.swap.can_swap_out(request):
            pairs = self.swap.swap_out(request)
            out.blocks_to_swap_out.extend(pairs)
            self.num_blocks_swapped_out += len(pairs)
            request.status = RequestStatus.SWAPPED
        else:
            self.kv.free(request)
            request.num_tokens_to_recompute = max(request.num_tokens_to_recompute, request.num_computed_tokens)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        out.preempted.append(request)
        self.waiting.add_front(request)

    def _swap_in(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        # every block the step needs (swapped-in ones and room for ``num_new`` tokens) must be free now:
        # a request swapped out mid-prefill resumes with more than one new block's worth of tokens
        needed = self.kv.num_blocks_needed(request.num_computed_tokens + num_new)
        if not self.swap.can_swap_in(request, needed):
            return False
        pairs = self.swap.swap_in(request)
        out.blocks_to_swap_in.extend(pairs)
        self.num_blocks_swapped_in += len(pairs)
        return True

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance ``num_computed_tokens``; return the requests that now sample a token, in batch order."""
        sampling = []
        for request, n in out.scheduled:
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens:
                sampling.append(request)
        return sampling

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and release everything it holds (blocks, swap blocks, queue slot)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        if request.status == RequestStatus.SWAPPED and self.swap is not None:
            self.swap.free(request)
        request.status = status
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
