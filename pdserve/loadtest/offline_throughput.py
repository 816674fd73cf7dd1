"""Offline throughput: pdserve ``LLM`` against HF transformers (static and continuous batching).

One workload — ``--num-requests`` requests with prompt lengths and output lengths drawn uniformly with a
fixed seed (random token ids), greedy, EOS ignored — run in one process, one system after another:

* ``pdserve``: ``LLM(...).generate(all prompts)`` (continuous batching over the paged KV cache);
* ``hf-static``: ``model.generate`` in batches of ``--hf-batch-size`` (left padding); each batch runs to
  its longest output, and only the requested tokens count;
* ``hf-continuous``: ``model.init_continuous_batching()`` with ``add_request(ids, max_new_tokens=...)``.

Prints output tokens/s per system and dtype, the ratios, pdserve's KV utilization at peak
(``peak_kv_tokens_live / (peak_kv_blocks_used * block_size)``) and how many sequences of this workload
held KV at once in a fixed budget against a static reservation of ``max_model_len`` per sequence.

    python -m pdserve.loadtest.offline_throughput            # bf16 and fp32, 128 requests
    python -m pdserve.loadtest.offline_throughput --dtypes bfloat16 --num-requests 32 --skip hf-continuous
"""

from __future__ import annotations

import json
import random
import time

import click
import torch
from tqdm.auto import tqdm

MODEL = "smollm2-135m-instruct"
ENGINE_MAX_MODEL_LEN = 1024


def make_workload(n: int, seed: int, vocab: int, prompt_range=(16, 256), output_range=(8, 128)):
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        prompts.append([rng.randrange(100, vocab) for _ in range(plen)])
        outputs.append(rng.randint(*output_range))
    return prompts, outputs


def run_pdserve(prompts, outputs, dtype, kv_tokens: int) -> dict:
    from pdserve import LLM, SamplingParams

    args = {"dtype": dtype, "max_num_seqs": 256, "max_num_batched_tokens": 2048,
            "max_model_len": ENGINE_MAX_MODEL_LEN,
            "num_kv_blocks": max(kv_tokens, ENGINE_MAX_MODEL_LEN) // 16 + 1}  # the engine needs one max_model_len
    llm = LLM(MODEL, **args)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()  # the measured run computes every prompt, the warm-up's four too
    llm.llm_engine.stats.reset_peaks()
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)  # LLM's own bar: requests done
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert tokens == sum(outputs), "pdserve did not produce the requested number of tokens"
    stats = llm.get_stats().as_dict()
    return {"seconds": elapsed, "output_tokens": tokens, "stats": stats}


def run_hf_static(prompts, outputs, dtype, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    from pdserve.shared.models.resolve import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=getattr(torch, dtype)).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"hf-static {dtype}", unit="batch"):
        batch, outs = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                           do_sample=False, pad_token_id=pad)
    return {"seconds": time.perf_counter() - start, "output_tokens": sum(outputs)}


def run_hf_continuous(prompts, outputs, dtype) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from pdserve.shared.models.resolve import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=getattr(torch, dtype)).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        for p, o in zip(prompts, outputs):
            manager.add_request(p, max_new_tokens=o)
        tokens = 0
        for _ in tqdm(prompts, desc=f"hf-continuous {dtype}", unit="req"):
            result = manager.get_result(timeout=600)
            tokens += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return {"seconds": elapsed, "output_tokens": tokens}


@click.command("throughput")
@click.option("--num-requests", default=128, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtypes", default="bfloat16,float32", show_default=True)
@click.option("--hf-batch-size", default=32, show_default=True)
@click.option("--kv-budget-tokens", default=8192, show_default=True,
              help="KV pool of the fit measurement (tokens); the throughput runs get a pool that holds every request.")
@click.option("--skip", multiple=True, type=click.Choice(["hf-static", "hf-continuous"]))
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def main(num_requests, seed, dtypes, hf_batch_size, kv_budget_tokens, skip, json_out) -> None:
    """Offline throughput: pdserve LLM vs HF static and continuous batching, one process."""
    torch.manual_seed(seed)
    prompts, outputs = make_workload(num_requests, seed, 49152)
    longest = max(len(p) + o for p, o in zip(prompts, outputs))
    whole = sum(-(-(len(p) + o) // 16) * 16 for p, o in zip(prompts, outputs))
    rows = []
    fit = None
    systems = ["pdserve"] + [s for s in ("hf-static", "hf-continuous") if s not in skip]
    click.echo(f"offline throughput: {num_requests} requests (prompts 16-256, outputs 8-128 tokens, "
               f"{sum(outputs)} output tokens), systems {', '.join(systems)} x dtypes {dtypes}, one after another; "
               f"pdserve runs twice for its first dtype (the second measures the KV fit). Minutes on 2 cores.")
    for dtype in dtypes.split(","):
        click.echo(f"[{dtype}] pdserve (model load and warm-up first)")
        pd = run_pdserve(prompts, outputs, dtype, whole)
        if fit is None:  # the fit is a property of the scheduler and the workload, not of the dtype
            click.echo(f"[{dtype}] pdserve, KV budget {kv_budget_tokens} tokens (the fit measurement)")
            fit = run_pdserve(prompts, outputs, dtype, kv_budget_tokens)["stats"]
        row = {"dtype": dtype, "pdserve_tok_s": pd["output_tokens"] / pd["seconds"], "pdserve_s": pd["seconds"]}
        if "hf-static" not in skip:
            click.echo(f"[{dtype}] HF transformers, static batches of {hf_batch_size}")
            hs = run_hf_static(prompts, outputs, dtype, hf_batch_size)
            row["hf_static_tok_s"] = hs["output_tokens"] / hs["seconds"]
        if "hf-continuous" not in skip:
            click.echo(f"[{dtype}] HF transformers, continuous batching")
            hc = run_hf_continuous(prompts, outputs, dtype)
            row["hf_continuous_tok_s"] = hc["output_tokens"] / hc["seconds"]
        s = pd["stats"]
        row["kv_utilization_at_peak"] = s["peak_kv_tokens_live"] / max(1, s["peak_kv_blocks_used"] * s["block_size"])
        row["peak_running_seqs"] = fit["peak_num_running"]
        row["static_fit_seqs"] = kv_budget_tokens // ENGINE_MAX_MODEL_LEN
        row["static_fit_seqs_workload_max"] = kv_budget_tokens // longest
        rows.append(row)
    click.echo(f"\nworkload: {num_requests} requests, prompts 16-256, outputs 8-128 tokens (seed {seed}), greedy, "
               f"ignore_eos; fit: KV budget {kv_budget_tokens} tokens, static reservation = max_model_len "
               f"{ENGINE_MAX_MODEL_LEN} per sequence (longest request of the workload: {longest})")
    click.echo(f"{'dtype':<10}{'pdserve tok/s':>15}{'HF static':>12}{'HF cont.':>12}{'x static':>10}{'x cont.':>10}"
               f"{'KV util@peak':>14}{'seqs (paged/static)':>22}")
    for r in rows:
        hs, hc = r.get("hf_static_tok_s"), r.get("hf_continuous_tok_s")
        click.echo(f"{r['dtype']:<10}{r['pdserve_tok_s']:>15.1f}{hs or float('nan'):>12.1f}{hc or float('nan'):>12.1f}"
                   f"{(r['pdserve_tok_s'] / hs) if hs else float('nan'):>10.2f}"
                   f"{(r['pdserve_tok_s'] / hc) if hc else float('nan'):>10.2f}"
                   f"{r['kv_utilization_at_peak']:>14.3f}"
                   f"{r['peak_running_seqs']:>12d} / {r['static_fit_seqs']:<4d}"
                   f" ({r['peak_running_seqs'] / max(1, r['static_fit_seqs']):.1f}x; "
                   f"{r['peak_running_seqs'] / max(1, r['static_fit_seqs_workload_max']):.1f}x vs {longest})")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
