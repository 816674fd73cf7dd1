"""``pdserve bench tp``: what tensor parallelism costs and saves, offline, on one machine.

For each TP size (default 1 and 3; the default model has 3 KV heads) one engine is loaded once, then the sizes
run the same decode workload in turns (``--rounds`` rounds): ``--batch`` requests of ``--prompt-len`` random
token ids, ``--output-len`` greedy tokens each, EOS ignored, all submitted at once. Reported per size:

- memory per rank: rank 0's weight bytes (its parameters: its shard of the split layers plus the replicated
  embedding, LM head and norms), its KV pool's bytes (``--num-kv-blocks`` blocks of its KV heads), and every
  rank process's USS (memory only that process holds; the ranks are forked, so RSS would count shared pages);
- decode steps (steps that schedule one token per request): median wall ms per step, split on rank 0 into the
  order broadcast to the other ranks (gloo), the all-reduces (two per layer: the time rank 0 waits in them,
  which includes waiting for the slowest rank) and compute (the rest);
- output tokens/s and tokens per CPU-second (CPU time of rank 0 and its rank processes together).

    pdserve bench tp --tp-sizes 1,3 --batch 8 --output-len 32 --rounds 3

The all-reduce timers wrap each layer's ``TPShard.all_reduce`` on rank 0 here, in the benchmark: the engine has
no timer on its hot path.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import click
import psutil

MODEL = "smollm2-135m-instruct"


class TimedShard:
    """A ``TPShard`` whose ``all_reduce`` adds its wall time to ``seconds`` (the shard is frozen: wrap it)."""

    def __init__(self, shard) -> None:
        self.shard, self.seconds, self.calls = shard, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.shard, name)

    def all_reduce(self, x):
        t0 = time.perf_counter()
        self.shard.all_reduce(x)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return x


def instrument(llm) -> dict:
    """Wrap rank 0's all-reduces and order broadcast and the step; returns the live counters (``steps``: a list of
    ``(wall_s, all_reduce_s, broadcast_s)`` per decode step)."""
    from pdserve.shared.models.tensor_parallel import TPShard

    engine, counters = llm.llm_engine, {"steps": []}
    timed = None
    for module in engine.model.modules() if engine.config.device == "cpu" else ():
        if isinstance(getattr(module, "tp", None), TPShard) and module.tp.size > 1:
            timed = timed or TimedShard(module.tp)
            module.tp = timed
    broadcast = [0.0]
    if engine.tp is not None:
        step = engine.tp.step

        def timed_step(*args):
            t0 = time.perf_counter()
            step(*args)
            broadcast[0] += time.perf_counter() - t0

        engine.tp.step = timed_step
    execute = engine.runner.execute_model

    def timed_execute(out):
        ar0, bc0, t0 = timed.seconds if timed else 0.0, broadcast[0], time.perf_counter()
        result = execute(out)
        if out.scheduled and all(n == 1 for _, n in out.scheduled):  # a decode step
            counters["steps"].append((time.perf_counter() - t0, (timed.seconds if timed else 0.0) - ar0,
                                      broadcast[0] - bc0))
        return result

    engine.runner.execute_model = timed_execute
    return counters


def memory(llm) -> dict:
    engine = llm.llm_engine
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    local = getattr(engine.kv_cache, "local", engine.kv_cache)
    procs = [psutil.Process()] + [psutil.Process(p.pid) for p in (engine.tp.procs if engine.tp else [])]
    return {"weights_mib": weights / 2**20, "kv_mib": local.kv.numel() * local.kv.element_size() / 2**20,
            "uss_mib": [p.memory_full_info().uss / 2**20 for p in procs]}


def cpu_seconds(llm) -> float:
    engine = llm.llm_engine
    procs = [psutil.Process()] + [psutil.Process(p.pid) for p in (engine.tp.procs if engine.tp else [])]
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def one_round(llm, counters: dict, prompts, output_len: int) -> dict:
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    counters["steps"].clear()
    c0, t0 = cpu_seconds(llm), time.perf_counter()
    outs = llm.generate([list(p) for p in prompts], params)
    wall, cpu = time.perf_counter() - t0, cpu_seconds(llm) - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = counters["steps"] or [(0.0, 0.0, 0.0)]
    return {"tok_s": tokens / wall, "tok_cpu_s": tokens / cpu, "tokens": [o.outputs[0].token_ids for o in outs],
            "step_ms": statistics.median(s[0] for s in steps) * 1e3,
            "all_reduce_ms": statistics.median(s[1] for s in steps) * 1e3,
            "broadcast_ms": statistics.median(s[2] for s in steps) * 1e3, "decode_steps": len(counters["steps"])}


def write_random_llama(dst: str, hidden: int = 2048, layers: int = 16, heads: int = 32, kv_heads: int = 8,
                       intermediate: int = 8192) -> str:
    """A Llama of the given shape with random weights (bf16 safetensors) and the default model's tokenizer, at
    ``dst``, for speed runs at TP sizes the default model cannot split (its 9 heads: TP 2 and 4). Returns ``dst``."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdserve.shared.models.resolve import resolve_model

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=49152,
                         max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(dst, safe_serialization=True)
    src = resolve_model(MODEL)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(src, name), dst)
    return dst


@click.command("tp")
@click.option("--model", default=MODEL, show_default=True, help="Model name or directory.")
@click.option("--device", default="cpu", show_default=True, help="cpu, or cuda (rank r on cuda:r).")
@click.option("--tp-sizes", default="1,3", show_default=True, help="Comma-separated tensor-parallel sizes.")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--batch", default=8, show_default=True, help="Requests per round, all submitted at once.")
@click.option("--prompt-len", default=64, show_default=True)
@click.option("--output-len", default=32, show_default=True)
@click.option("--rounds", default=3, show_default=True, help="Rounds; the sizes take turns in each.")
@click.option("--num-kv-blocks", default=256, show_default=True, help="KV blocks per rank (the same at every size).")
def tp_command(model: str, device: str, tp_sizes: str, dtype: str, batch: int, prompt_len: int, output_len: int, rounds: int,
               num_kv_blocks: int) -> None:
    """Memory per rank and decode step time (compute vs all-reduce) at several tensor-parallel sizes."""
    from pdserve import LLM

    sizes = [int(s) for s in tp_sizes.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_len)] for _ in range(batch)]
    llms = {tp: LLM(model, dtype=dtype, tensor_parallel_size=tp, num_kv_blocks=num_kv_blocks, device=device,
                    enable_prefix_caching=False) for tp in sizes}
    counters = {tp: instrument(llm) for tp, llm in llms.items()}
    results: dict[int, list[dict]] = {tp: [] for tp in sizes}
    try:
        one_round(llms[sizes[0]], counters[sizes[0]], prompts[:1], 2)  # warm-up (kernel builds, first allocations)
        for _ in range(rounds):
            for tp in sizes:
                results[tp].append(one_round(llms[tp], counters[tp], prompts, output_len))
        base = results[sizes[0]][0]["tokens"]
        click.echo(f"batch {batch}, prompt {prompt_len}, output {output_len}, {dtype}, {rounds} rounds in turns, "
                   f"{os.cpu_count()} CPUs, torch threads rank 0 {__import__('torch').get_num_threads()}")
        click.echo("tp  weights/rank MiB  KV/rank MiB  USS per rank MiB      step ms  all-reduce ms  broadcast ms  "
                   "compute ms  tok/s  tok/CPU-s  same tokens")
        for tp in sizes:
            mem, rs = memory(llms[tp]), results[tp]
            med = {k: statistics.median(r[k] for r in rs) for k in
                   ("step_ms", "all_reduce_ms", "broadcast_ms", "tok_s", "tok_cpu_s")}
            same = all(r["tokens"] == base for r in rs)
            click.echo(f"{tp:<3} {mem['weights_mib']:16.1f} {mem['kv_mib']:12.1f}  "
                       f"{'/'.join(f'{u:.0f}' for u in mem['uss_mib']):<20} {med['step_ms']:8.1f} "
                       f"{med['all_reduce_ms']:14.1f} {med['broadcast_ms']:13.1f} "
                       f"{med['step_ms'] - med['all_reduce_ms'] - med['broadcast_ms']:11.1f} {med['tok_s']:6.1f} "
                       f"{med['tok_cpu_s']:10.1f}  {same}")
        click.echo(f"load average {os.getloadavg()}")
    finally:
        for llm in llms.values():
            if llm.llm_engine.tp is not None:
                llm.llm_engine.tp.close()
