"""``pdserve bench structured``: the cost of a grammar (structured outputs) on decode, offline, in one process.

At each batch size, all requests submitted at once, greedy, ``--output-len`` tokens each: ``plain`` (no grammar,
EOS ignored) and ``json`` (a JSON schema of a long array, so every answer runs the full length under the
grammar), in turns (plain, json, plain, json, ...; the median of the turns is reported). TPOT per request is
(finish - first token) / (N - 1), median over the batch. Also the time to compile a schema, cold (a spec the
engine has not seen) and cached, from admission to compiled grammar. Reports CPU-seconds of this process and
the load average beside wall time.

    pdserve bench structured --batch-sizes 1,32 --output-len 64 --repeats 2
"""

from __future__ import annotations

import json
import os
import statistics
import time

import click

MODEL = "smollm2-135m-instruct"
# every answer is long (64 numbers of up to 3 digits), so max_tokens ends it, never the grammar
LONG_SCHEMA = {"type": "object", "properties": {"readings": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 64, "maxItems": 64}},
    "required": ["readings"], "additionalProperties": False}


def _prompts(tokenizer, n: int) -> list[list[int]]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "List 64 sensor readings as JSON."}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [ids for _ in range(n)]


def run_once(llm, prompts: list[list[int]], output_len: int, structured: dict | None) -> dict:
    """One batch to the end; wall and CPU seconds, median TPOT (ms)."""
    from pdserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=structured is None,
                            structured_outputs=structured)
    t0, c0 = time.perf_counter(), time.process_time()
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"s{time.monotonic_ns()}-{i}", p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = (now, len(out.outputs[0].token_ids))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tpot = statistics.median((end - first[r]) / max(n - 1, 1) for r, (end, n) in done.items())
    tokens = sum(n for _, n in done.values())
    return {"tpot_ms": tpot * 1000, "wall_s": wall, "cpu_s": cpu, "tokens": tokens}


def compile_times(llm, schemas: list[dict]) -> dict:
    """Milliseconds from ``grammar_for`` to a compiled grammar per schema: cold (unseen spec), then cached."""
    from pdserve import SamplingParams

    manager = llm.llm_engine.structured
    out = {"cold_ms": [], "cached_ms": []}
    for i, schema in enumerate(schemas):
        params = SamplingParams(structured_outputs={"json": {**schema, "title": f"bench-{time.time_ns()}-{i}"}})
        for kind in ("cold_ms", "cached_ms"):
            t0 = time.perf_counter()
            manager.grammar_for(params)._future.result()
            out[kind].append((time.perf_counter() - t0) * 1000)
    return out


@click.command("structured")
@click.option("--model", default=MODEL, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--batch-sizes", default="1,32", show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=2, show_default=True, help="Turns per (batch, mode).")
@click.option("--output-json", default=None, help="Write the results here.")
def structured_command(model, dtype, batch_sizes, output_len, repeats, output_json):
    """TPOT with a JSON schema vs without, in turns, and schema compile time cold and cached."""
    from pdserve import LLM

    llm = LLM(model, dtype=dtype, max_model_len=1024)
    tok = llm.get_tokenizer()
    run_once(llm, _prompts(tok, 2), 8, None)  # warm-up (and the tokenizer tables of the grammar compiler)
    run_once(llm, _prompts(tok, 2), 8, {"json": LONG_SCHEMA})
    from pdserve.loadtest.structured_schemas import BENCH_SCHEMAS

    compiled = compile_times(llm, BENCH_SCHEMAS)
    click.echo(f"load average {os.getloadavg()[0]:.1f}; compile ms cold "
               + " ".join(f"{x:.2f}" for x in compiled["cold_ms"]) + "; cached "
               + " ".join(f"{x:.3f}" for x in compiled["cached_ms"]))
    rows = []
    for batch in (int(b) for b in batch_sizes.split(",")):
        prompts = _prompts(tok, batch)
        runs: dict[str, list[dict]] = {"plain": [], "json": []}
        for _ in range(repeats):
            runs["plain"].append(run_once(llm, prompts, output_len, None))
            runs["json"].append(run_once(llm, prompts, output_len, {"json": LONG_SCHEMA}))
        row = {"batch": batch, "load_avg": os.getloadavg()[0],
               **{mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}}
        row["tpot_overhead"] = row["json"]["tpot_ms"] / row["plain"]["tpot_ms"] - 1
        rows.append(row)
        click.echo(f"batch {batch:3d}: TPOT plain {row['plain']['tpot_ms']:7.2f} ms (CPU {row['plain']['cpu_s']:.1f} s)"
                   f"  json {row['json']['tpot_ms']:7.2f} ms (CPU {row['json']['cpu_s']:.1f} s)  "
                   f"overhead {row['tpot_overhead'] * 100:+.1f}%  load {row['load_avg']:.1f}")
    if output_json:
        with open(output_json, "w") as f:
            json.dump({"compile": compiled, "rows": rows}, f, indent=2)
