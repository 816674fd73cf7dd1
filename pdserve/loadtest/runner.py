"""The load loop: gamma arrivals, an optional concurrency cap, multi-turn ordering, live progress.

Every request is dispatched at its intended time whatever happened to earlier ones (open loop: no
coordinated omission); how late the client itself was is recorded per request (``send_lag``) and the
event loop's own lag is sampled, so an overloaded client shows up in the result instead of hiding in it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.loadtest.arrivals import arrival_times
from pdserve.loadtest.client import ClientConfig, build_body, make_session, send_streaming
from pdserve.loadtest.request import SampleRequest
from pdserve.loadtest.timeline import RequestRecord


@dataclass(slots=True)
class RunConfig:
    """Arrival process and limits of one benchmark run."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    show_progress: bool = True
    num_warmups: int = 0


@dataclass(slots=True)
class RunOutcome:
    """Per-request records plus what the client measured about itself."""

    records: list[RequestRecord]
    duration_s: float
    started_at: float  # wall clock (time.time())
    loop_lag_ms: list[float] = field(default_factory=list)
    client_cpu_s: float = 0.0


async def _sample_loop_lag(out: list[float], period: float = 0.01) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        out.append(max(0.0, (time.perf_counter() - t - period) * 1000.0))


def _raise_fd_limit() -> None:
    """Allow as many sockets as the hard limit: an uncapped run opens one connection per request in flight."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 16
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


async def _warm_up(session, client: ClientConfig, requests: Sequence[SampleRequest], n: int) -> None:
    """Send the first ``n`` prompts (at most 8 at once) and discard them: connections and server caches warm."""
    sem = asyncio.Semaphore(8)

    async def one(req: SampleRequest) -> None:
        async with sem:
            body = build_body(client, req.prompt, None, req.expected_output_len)
            await send_streaming(session, client, body, RequestRecord(index=-1))

    await asyncio.gather(*(one(requests[i % len(requests)]) for i in range(n)))


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)


async def run_benchmark(
    requests: Sequence[SampleRequest], client: ClientConfig, run: RunConfig
) -> RunOutcome:
    """Send ``requests`` as configured and return their records (in dataset order)."""
    n = len(requests)
    offsets = arrival_times(n, run.request_rate, run.burstiness, run.seed)
    sem = asyncio.Semaphore(run.max_concurrency) if run.max_concurrency else None
    histories: dict[int, list[dict]] = {}
    turn_done: dict[tuple[int, int], asyncio.Event] = {}
    for r in requests:
        if r.session_id is not None:
            turn_done[(r.session_id, r.turn or 0)] = asyncio.Event()
    records: list[RequestRecord | None] = [None] * n
    bar = _progress(n, run.show_progress)
    failed = 0
    lag_samples: list[float] = []

    _raise_fd_limit()
    session = make_session(client, run.max_concurrency)
    if run.num_warmups:
        await _warm_up(session, client, requests, run.num_warmups)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    lag_task = asyncio.create_task(_sample_loop_lag(lag_samples))

    async def one(i: int, req: SampleRequest, intended: float) -> None:
        nonlocal failed
        rec = RequestRecord(index=i, label=req.label, prompt_len=req.prompt_len,
                            expected_output_len=req.expected_output_len,
                            session_id=req.session_id, turn=req.turn)
        rec.dispatch = time.perf_counter() - t0
        messages = None
        if req.session_id is not None:
            prev = turn_done.get((req.session_id, (req.turn or 0) - 1))
            if prev is not None and not prev.is_set():
                await prev.wait()
                # the turn could not be sent before its predecessor finished: that wait is not client lag
                intended = max(intended, time.perf_counter() - t0)
                rec.dispatch = time.perf_counter() - t0
            messages = histories.setdefault(req.session_id, []) + [{"role": "user", "content": req.prompt}]
        rec.intended_send = intended
        try:
            if sem is not None:
                async with sem:
                    await _send(rec, req, messages)
            else:
                await _send(rec, req, messages)
        finally:
            if req.session_id is not None:
                histories[req.session_id] = (messages or []) + [
                    {"role": "assistant", "content": rec.generated_text}]
                turn_done[(req.session_id, req.turn or 0)].set()
            records[i] = rec
            failed += not rec.success
            if bar is not None:
                bar.update(1)
                if not rec.success or bar.n % 50 == 0:
                    bar.set_postfix(failed=failed, refresh=False)

    async def _send(rec: RequestRecord, req: SampleRequest, messages: list[dict] | None) -> None:
        rec.actual_send = time.perf_counter() - t0
        if messages is None:
            body = build_body(client, req.prompt, None, req.expected_output_len)
        else:
            body = build_body(client, None, messages, req.expected_output_len)
        await send_streaming(session, client, body, rec)

    tasks: list[asyncio.Task] = []
    try:
        for i, (req, off) in enumerate(zip(requests, offsets)):
            # event loops wake timers up to their clock resolution early: sleep again until truly due
            while (delay := t0 + float(off) - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req, float(off))))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        lag_task.cancel()
        await session.close()
        if bar is not None:
            bar.close()
    duration = time.perf_counter() - t0
    return RunOutcome(
        records=[r for r in records if r is not None],
        duration_s=duration,
        started_at=time.time() - duration,
        loop_lag_ms=lag_samples,
        client_cpu_s=time.process_time() - cpu0,
    )


def loop_lag_summary(samples: Sequence[float]) -> dict[str, float]:
    """Event-loop oversleep of a 10 ms timer during the run, in ms (a busy client shows here first)."""
    arr = np.asarray(samples or [0.0])
    return {"mean_client_loop_lag_ms": float(arr.mean()), "p99_client_loop_lag_ms": float(np.percentile(arr, 99))}
