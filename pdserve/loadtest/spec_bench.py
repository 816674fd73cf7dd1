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


def write_truncated_model(src, dst, num_layers: int) -> str:
    """Write a draft model for tests and this benchmark: the checkpoint in directory ``src`` cut to its first
    ``num_layers`` decoder layers (embeddings, final norm and head kept; same tokenizer files), as a HF
    directory at ``dst`` that the real loader reads. Returns ``str(dst)``."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    keep = {f"model.layers.{i}." for i in range(num_layers)}
    for path in src.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({n: t.contiguous() for n, t in tensors.items()
                   if not n.startswith("model.layers.") or any(n.startswith(k) for k in keep)},
                  dst / path.name, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            (dst / path.name).write_bytes(path.read_bytes())
    return str(dst)


def copy_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + PARAGRAPHS[i % len(PARAGRAPHS)]}],
            add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # transformers 5: a BatchEncoding
    return out


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
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    tokens = len(prompts) * output_len
    return {"tok_s": tokens / wall, "tok_per_cpu_s": tokens / cpu, "tpot_ms": tpot * 1000, "wall_s": wall,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0}


def _median_runs(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _format_row(row: dict) -> str:
    plain = row["plain"]
    text = (f"{row['workload']:6s} batch {row['batch']:3d}: plain {plain['tok_s']:7.1f} tok/s (TPOT "
            f"{plain['tpot_ms']:6.1f} ms, {plain['tok_per_cpu_s']:6.1f} tok/CPU-s)")
    for mode in ("spec", "fixed"):
        if mode in row:
            r = row[mode]
            row[f"speedup_{mode}"] = r["tok_s"] / plain["tok_s"]
            text += (f"  {mode} {r['tok_s']:7.1f} tok/s (TPOT {r['tpot_ms']:6.1f} ms, {r['tok_per_cpu_s']:6.1f} "
                     f"tok/CPU-s) x{row[f'speedup_{mode}']:.2f} (TPOT x{plain['tpot_ms'] / r['tpot_ms']:.2f}, per CPU-s x{r['tok_per_cpu_s'] / plain['tok_per_cpu_s']:.2f}) "
                     f"accept {r['acceptance_rate']:.2f} mean len {r['mean_accepted_length']:.2f}")
    return text + f"  load {row['load_avg']:.1f}"


@click.command("spec")
@click.option("--model", default=MODEL, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--batch-sizes", default="1,4,16,64", show_default=True)
@click.option("--workloads", default="copy,random", show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=2, show_default=True, help="Turns per (workload, batch, mode).")
@click.option("--speculative-config", default=DEFAULT_SPEC, show_default=True)
@click.option("--compare-fixed-k", is_flag=True,
              help="Also run the same config with \"adaptive\": false (the adaptive policy's effect).")
@click.option("--output-json", default=None, help="Write the results here.")
def spec_command(model, dtype, batch_sizes, workloads, output_len, repeats, speculative_config, compare_fixed_k,
                 output_json):
    """Decode tok/s and TPOT with and without speculative decoding (copy vs random prompts)."""
    from pdserve import LLM

    engines = {"plain": LLM(model, dtype=dtype, max_model_len=1024),
               "spec": LLM(model, dtype=dtype, max_model_len=1024, speculative_config=speculative_config)}
    if compare_fixed_k:
        fixed = {**json.loads(speculative_config), "adaptive": False}
        engines["fixed"] = LLM(model, dtype=dtype, max_model_len=1024, speculative_config=fixed)
    tok = engines["plain"].get_tokenizer()
    vocab = engines["plain"].llm_engine.vocab_size
    for llm in engines.values():  # warm-up
        run_once(llm, copy_prompts(tok, 2), 8)
    rows = []
    click.echo(f"load average {os.getloadavg()[0]:.1f}; spec config {speculative_config}")
    for workload in workloads.split(","):
        for batch in (int(b) for b in batch_sizes.split(",")):
            prompts = copy_prompts(tok, batch) if workload == "copy" else random_prompts(batch, vocab)
            runs = {mode: [] for mode in engines}
            for _ in range(repeats):
                for mode, llm in engines.items():
                    runs[mode].append(run_once(llm, prompts, output_len))
            row = {"workload": workload, "batch": batch, "load_avg": os.getloadavg()[0],
                   **{mode: _median_runs(r) for mode, r in runs.items()}}
            rows.append(row)
            click.echo(_format_row(row))
    if output_json:
        with open(output_json, "w") as f:
            json.dump(rows, f, indent=2)
