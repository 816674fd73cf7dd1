"""Benchmark metrics exactly as vLLM ``bench serve`` defines them (``vllm/benchmarks/serve.py``).

- TTFT: send to first content chunk. E2EL: send to last content chunk.
- TPOT = (E2EL - TTFT) / (N - 1), N = output tokens from the server's ``usage``; requests with
  N <= 1 are left out of TPOT statistics and count as TPOT 0 for goodput.
- ITL: one sample per content chunk after the first (a chunk may carry several tokens; how many is
  recorded per chunk, see :class:`~pdserve.loadtest.timeline.RequestRecord`).
- Throughputs divide by the benchmark duration; goodput counts requests meeting every SLO
  (``--goodput``, DistServe's definition).
- mean / median / std (population) / percentiles by ``numpy`` (linear interpolation), in ms; an empty
  sample gives 0, as vLLM does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from pdserve.loadtest.timeline import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")


def output_len(rec: RequestRecord, count_tokens: Callable[[str], int] | None = None) -> int:
    """N for a successful request: ``usage``, else summed per-chunk counts, else the tokenizer, else chunks."""
    if rec.output_tokens is not None:
        return rec.output_tokens
    if rec.chunk_tokens and all(c is not None for c in rec.chunk_tokens):
        return int(sum(rec.chunk_tokens))  # type: ignore[arg-type]
    if count_tokens is not None:
        return count_tokens(rec.generated_text)
    return len(rec.chunk_tokens)


def request_tpot(rec: RequestRecord, n: int) -> float | None:
    """TPOT in seconds, or ``None`` when N <= 1 (no decode interval to average)."""
    if n <= 1:
        return None
    return (rec.latency - rec.ttft) / (n - 1)


def percentile_key(p: float) -> str:
    """vLLM's key spelling: 99 -> ``p99``, 99.9 -> ``p99.9``."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def stats_ms(values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean/median/std and percentiles of seconds ``values``, in ms (0 for an empty sample)."""
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(np.mean(arr)), "median": float(np.median(arr)), "std": float(np.std(arr))}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(arr, p))
    return out


def is_good(ttft: float, tpot: float, e2el: float, slos_ms: dict[str, float]) -> bool:
    """True when the request meets every SLO given in ms (DistServe goodput; TPOT 0 when N <= 1)."""
    values = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    return all(values[k] * 1000.0 <= v for k, v in slos_ms.items())


def _peak_tokens_per_second(records: Sequence[RequestRecord], lens: Sequence[int]) -> float:
    """Most output tokens that arrived within one wall-clock second of the run (vLLM's max_output_tokens_per_s)."""
    buckets: Counter[int] = Counter()
    for rec, n in zip(records, lens):
        if not rec.success:
            continue
        t = rec.actual_send + rec.ttft
        times = [t]
        for gap in rec.itl:
            t += gap
            times.append(t)
        counts = list(rec.chunk_tokens)
        if any(c is None for c in counts):
            # unknown split: spread N evenly over the chunks
            counts = [n / len(times)] * len(times)
        for ts, c in zip(times, counts):
            buckets[int(ts)] += c  # type: ignore[operator]
    return float(max(buckets.values(), default=0))


def _peak_concurrency(records: Sequence[RequestRecord]) -> int:
    events: list[tuple[float, int]] = []
    for rec in records:
        if rec.success:  # a failed request's time in flight is unknown
            events.append((rec.actual_send, 1))
            events.append((rec.actual_send + rec.latency, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    percentile_metrics: Sequence[str] = METRICS,
    percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """Aggregate per-request records into vLLM's result keys plus pdserve's extras.

    Input lengths prefer the server's ``usage.prompt_tokens`` (what it actually processed) over the
    dataset's count. ``duration_s`` is the wall time from the first dispatch to the last completion.
    """
    assert duration_s > 0
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    output_lens: list[int] = []
    input_lens: list[int] = []
    completed = good = 0
    total_input = 0
    for rec in records:
        plen = rec.usage_prompt_tokens if rec.usage_prompt_tokens is not None else rec.prompt_len
        input_lens.append(plen)
        if not rec.success:
            output_lens.append(0)
            continue
        n = output_len(rec, count_tokens)
        output_lens.append(n)
        total_input += plen
        tpot = request_tpot(rec, n)
        if tpot is not None:
            tpots.append(tpot)
        all_tpots.append(tpot or 0.0)
        itls.extend(rec.itl)
        ttfts.append(rec.ttft)
        e2els.append(rec.latency)
        completed += 1
        if goodput_slos_ms and is_good(rec.ttft, tpot or 0.0, rec.latency, goodput_slos_ms):
            good += 1

    failed = len(records) - completed
    total_output = sum(output_lens)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": failed,
        "num_requests": len(records),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput_slos_ms else None,
        "goodput_slos_ms": dict(goodput_slos_ms) if goodput_slos_ms else None,
        "slo_attainment": good / len(records) if goodput_slos_ms and records else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": _peak_tokens_per_second(records, output_lens),
        "max_concurrent_requests": _peak_concurrency(records),
        "failed_by_status": dict(Counter(r.status for r in records if not r.success)),
    }
    samples = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in percentile_metrics:
        for stat, value in stats_ms(samples[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value

    lags = [r.send_lag for r in records]
    waits = [r.queue_wait for r in records]
    for stat, value in stats_ms(lags, [99.0]).items():
        result[f"{stat}_send_lag_ms"] = value
    result["max_send_lag_ms"] = max(lags, default=0.0) * 1000.0
    # The client's own --max-concurrency queue: TTFT and E2EL start when a request is sent, so a request that
    # waited for a slot looks fast; a user sees wait + latency (the queue-inclusive latencies).
    done = [r for r in records if r.success]
    for name, values in (("queue_wait", waits), ("ttft_incl_queue", [r.queue_wait + r.ttft for r in done]),
                         ("e2el_incl_queue", [r.queue_wait + r.latency for r in done])):
        for stat, value in stats_ms(values, sorted(set(percentiles) | {99.0})).items():
            result[f"{stat}_{name}_ms"] = value

    result["input_lens"] = input_lens
    result["output_lens"] = output_lens
    result["ttfts"] = [r.ttft for r in records]
    result["itls"] = [r.itl for r in records]
    result["itl_chunk_tokens"] = [r.chunk_tokens for r in records]
    result["generated_texts"] = [r.generated_text for r in records]
    result["errors"] = [r.error for r in records]
    result["statuses"] = [r.status for r in records]
    return result


def good_fraction(records: Sequence[RequestRecord], slos_ms: dict[str, float]) -> float:
    """Share of *all* requests (failed ones count as missing) meeting every SLO in ``slos_ms``."""
    if not records:
        return math.nan
    good = 0
    for rec in records:
        if rec.success:
            tpot = request_tpot(rec, output_len(rec)) or 0.0
            good += is_good(rec.ttft, tpot, rec.latency, slos_ms)
    return good / len(records)
