"""``pdserve bench prefill-budget``: the prefill tier's step token budget (``max_num_batched_tokens``) on a burst.

A burst of ``--num-requests`` random-id prompts (16-256 tokens, as ``ensemble-cpu`` and ``throughput`` use) arrives
at once at one engine, as a prefill pod sees it when a burst reaches the queue: each request is prefilled and samples
its first token (``max_tokens=1``), which is all a prefill pod computes before the KV hand-over. One engine is loaded
once; the budgets take turns on it (512, 2048, 4096, 8192, 512, ...), the scheduler's budget set between turns, so
load drift hits every budget alike. Per budget it prints prompt tokens per second and per CPU-second of this process,
the time from the burst to each request's first token (TTFT at the pod: p50 and p99), the engine steps and the peak
batch, and the process's peak RSS after the budget's first turn (budgets in ascending order, so the high-water mark
grows only if the larger budget needs more: the activations of a step scale with its tokens).

    pdserve bench prefill-budget --budgets 512,2048,4096,8192 --rounds 3 --threads 1

``--threads 1`` is what a prefill pod gets under ``pdserve up`` 1P+1D on 2 cores.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import click


def _burst(engine, prompts: list[list[int]], params, tag: str) -> dict:
    """Add every prompt at once, step until all have their first token; TTFTs (s), CPU-s, steps, peak batch."""
    start, cpu0 = time.perf_counter(), time.process_time()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    ttft: dict[str, float] = {}
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        now = time.perf_counter() - start
        for o in outs:
            if o.outputs and o.outputs[0].token_ids:
                ttft.setdefault(o.request_id, now)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu0,
            "ttfts": sorted(ttft.values()), "steps": steps, "peak_num_running": engine.stats.peak_num_running}


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


@click.command("prefill-budget")
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
@click.option("--budgets", default="512,2048,4096,8192", show_default=True, help="Token budgets per step, in turns.")
@click.option("--num-requests", default=32, show_default=True, help="Prompts that arrive together.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch threads (a 1P+1D prefill pod on 2 cores: 1).")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]))
@click.option("--seed", default=0, show_default=True)
def prefill_budget_command(model, budgets, num_requests, rounds, threads, dtype, seed) -> None:
    """Prompt tokens per CPU-s, TTFT p50/p99 and peak RSS of a burst, per prefill step budget, in turns."""
    import torch
    from transformers import AutoConfig

    from pdserve import LLM, SamplingParams
    from pdserve.loadtest.offline_throughput import make_workload
    from pdserve.shared.models.resolve import resolve_model

    torch.set_num_threads(threads)
    sizes = sorted(int(b) for b in budgets.split(","))
    llm = LLM(model, dtype=dtype, max_num_seqs=256, max_num_batched_tokens=max(sizes), max_model_len=1024,
              kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompts, _ = make_workload(num_requests, seed, AutoConfig.from_pretrained(str(resolve_model(model))).vocab_size)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    click.echo(f"prefill-budget: {num_requests} prompts at once ({sum(map(len, prompts))} tokens, 16-256 each), "
               f"{dtype}, {threads} thread(s), budgets {sizes} in turns x {rounds}; peak RSS after warm-up "
               f"{rss0:.0f} MiB; load average {os.getloadavg()[0]:.1f}")
    runs: dict[int, list[dict]] = {b: [] for b in sizes}
    rss: dict[int, float] = {}
    for r in range(rounds):
        for b in sizes:
            engine.scheduler.max_num_batched_tokens = b
            engine.stats.reset_peaks()
            res = _burst(engine, prompts, params, f"r{r}b{b}")
            res["loadavg"] = os.getloadavg()[0]
            runs[b].append(res)
            rss.setdefault(b, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            click.echo(f"  round {r + 1} budget {b:>5}: {res['seconds']:6.2f} s {res['cpu_seconds']:6.2f} CPU-s, "
                       f"{res['steps']} steps, peak batch {res['peak_num_running']}, TTFT p50 "
                       f"{_pct(res['ttfts'], 50):.2f} p99 {_pct(res['ttfts'], 99):.2f} s, load {res['loadavg']:.1f}")
    tokens = sum(map(len, prompts))
    click.echo(f"\n{'budget':>7}{'tok/s':>9}{'tok/CPU-s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'steps':>7}"
               f"{'peak batch':>12}{'peak RSS MiB':>14}   (medians over rounds)")
    for b in sizes:
        rs = runs[b]
        med = statistics.median
        click.echo(f"{b:>7}{med(tokens / x['seconds'] for x in rs):>9.0f}"
                   f"{med(tokens / x['cpu_seconds'] for x in rs):>11.0f}"
                   f"{med(_pct(x['ttfts'], 50) for x in rs):>10.2f}{med(_pct(x['ttfts'], 99) for x in rs):>10.2f}"
                   f"{med(x['steps'] for x in rs):>7.0f}{max(x['peak_num_running'] for x in rs):>12}"
                   f"{rss[b]:>14.0f}")
