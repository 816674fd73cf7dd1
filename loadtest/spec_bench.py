"""``pdserve bench spec``: decode speed with and without speculative decoding, offline, in one process.

Two workloads at each batch size (all requests submitted at once, greedy, ``--output-len`` tokens each,
EOS ignored): ``copy`` (chat prompts asking to repeat a paragraph: the answer copies the prompt, where
n-gram drafts are accepted) and ``random`` (random token ids: drafts rarely match). Each (workload, batch)
runs plain, then speculative, then plain and speculative again (turns; the median of the runs is
reported), on two engines loaded once. Reports output tokens/s, tokens per CPU-second (this process),
median TPOT ((finish - first token) / (N - 1) per request), acceptance rate and mean accepted length.

    pdserve bench spec --dtype bfloat16 --batch-sizes 1,4,16,64 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

import click

MODEL = "smollm2-135m-instruct"
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
PARAGRAPHS = [
    "The history of the city begins with a small settlement on the river bank, where traders from the north met "
    "farmers from the valley. Over the centuries the market grew into a town, the town built walls, and the walls "
    "were replaced by boulevards.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= "
    "b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n    return "
    "out + a[i:] + b[j:]",
    "Visitors often ask why the bridges are painted in different colours; the answer lies in the guilds that paid "
    "for them, each choosing its own. Their names are carved under the arches, next to the year.",
    "Order 4411: two boxes of blue ceramic tiles, one bag of grout, delivery to 18 Harbour Street on Tuesday "
    "morning, payment by card, contact Mrs. Elena Ruiz at the front desk.",
]


def copy_prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + PARAGRAPHS[i % len(PARAGRAPHS)]}],
        add_generation_prompt=True) for i in range(n)]


def random_prompts(n: int, vocab: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_once(llm, prompts: list[list[int]], output_len: int) -> dict:
    """Drive the engine step by step; returns tokens, wall and CPU seconds, median TPOT, spec counters."""
    from pdserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    before = engine.get_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.get_stats()
    tpot = statistics.median((done[r] - first[r]) / (output_len - 1) for r in done) if output_len > 1 else 0.0
    drafts = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
    draft_tokens = after.get("spec_decode_num_draft_tokens", 0) - before.get("spec_decode_num_draft_tokens", 0)
    accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
    tokens = len(prompts) * output_len
    return {"tok_s": tokens / wall, "tok_per_cpu_s": tokens / cpu, "tpot_ms": tpot * 1000, "wall_s": wall,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0}


def _median_runs(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


@click.command("spec")
@click.option("--model", default=MODEL, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--batch-sizes", default="1,4,16,64", show_default=True)
@click.option("--workloads", default="copy,random", show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=2, show_default=True, help="Turns per (workload, batch, mode).")
@click.option("--speculative-config", default=DEFAULT_SPEC, show_default=True)
@click.option("--output-json", default=None, help="Write the results here.")
def spec_command(model, dtype, batch_sizes, workloads, output_len, repeats, speculative_config, output_json):
    """Decode tok/s and TPOT with and without speculative decoding (copy vs random prompts)."""
    from pdserve import LLM

    engines = {"plain": LLM(model, dtype=dtype, max_model_len=1024),
               "spec": LLM(model, dtype=dtype, max_model_len=1024, speculative_config=speculative_config)}
    tok = engines["plain"].get_tokenizer()
    vocab = engines["plain"].llm_engine.vocab_size
    for llm in engines.values():  # warm-up
        run_once(llm, copy_prompts(tok, 2), 8)
    rows = []
    click.echo(f"load average {os.getloadavg()[0]:.1f}; spec config {speculative_config}")
    for workload in workloads.split(","):
        for batch in (int(b) for b in batch_sizes.split(",")):
            prompts = copy_prompts(tok, batch) if workload == "copy" else random_prompts(batch, vocab)
            runs = {"plain": [], "spec": []}
            for _ in range(repeats):
                for mode, llm in engines.items():
                    runs[mode].append(run_once(llm, prompts, output_len))
            plain, spec = _median_runs(runs["plain"]), _median_runs(runs["spec"])
            row = {"workload": workload, "batch": batch, "plain": plain, "spec": spec,
                   "speedup": spec["tok_s"] / plain["tok_s"], "load_avg": os.getloadavg()[0]}
            rows.append(row)
            click.echo(f"{workload:6s} batch {batch:3d}: plain {plain['tok_s']:7.1f} tok/s (TPOT {plain['tpot_ms']:6.1f} ms, "
                       f"{plain['tok_per_cpu_s']:6.1f} tok/CPU-s)  spec {spec['tok_s']:7.1f} tok/s (TPOT "
                       f"{spec['tpot_ms']:6.1f} ms, {spec['tok_per_cpu_s']:6.1f} tok/CPU-s)  x{row['speedup']:.2f}  "
                       f"accept {spec['acceptance_rate']:.2f} mean len {spec['mean_accepted_length']:.2f}  "
                       f"load {row['load_avg']:.1f}")
    if output_json:
        with open(output_json, "w") as f:
            json.dump(rows, f, indent=2)
