"""``pdserve bench step``: one engine step measured on its own against its matmul floor.

The real engine (``LLMEngine``, the real model, every CPU fast path as configured) runs a batch of requests
(prompts of random ids, 16-256 tokens by default, greedy, ``ignore_eos``): first their prefill, in steps of the
engine's token budget, then decode steps with the whole batch running. Each step is timed from the outside
(``engine.step()``: scheduling, input preparation, the forward pass, the LM head, sampling, output
processing), in CPU-ms of the process and wall-ms. Right after it, in the same process, the **matmul floor**
of that step is measured: the same linear layers (every layer's q/k/v, o, gate/up, down projection on the
step's rows, the LM head on its sampling rows) with the model's own weights, through the path pdserve takes
for them (fp32 weight copies: ``cpu_linear.skinny_linear`` for up to ``MAX_ROWS`` rows, MKL's sgemm through
``F.linear`` above; the model's own dtype where it has no fp32 copies) and nothing else, so the floor's GEMM
rate is that of the step's own shapes with the same cache behaviour (all layers in order). Step and floor run
in turns, and 1 and 2 threads in turns, so load from other work falls on both alike.

Printed per thread count: decode step CPU-ms and wall-ms (median of every measured step), its floor and the
ratio (the target: <= 1.5x at batch 32); prefill prompt tokens per CPU-second against the bound (the
same steps' linear FLOPs at their measured rate; target >= 60%); and where a decode step goes (``--breakdown-steps``, in the last round):
exclusive CPU-ms per part, from timers wrapped around the kernels and engine methods for separate steps (the
torch profiler does not see the ctypes kernels, which is where most of a step runs).

    pdserve bench step                                    # batch 32, threads 1 and 2, 3 rounds
    pdserve bench step --threads 1 --rounds 5 --json-out step.json
    PDSERVE_FUSED_CPU=0 pdserve bench step --attention-backend torch   # the fast paths off, for an A/B
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import time

import click
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_attention, cpu_elementwise, cpu_linear

MODEL = "smollm2-135m-instruct"


def _linears(model) -> list[torch.nn.Module]:
    """Every per-token projection of the model, in the order a step runs them."""
    out = []
    for layer in model.layers:
        out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return out


def _gemm(x: torch.Tensor, w: torch.Tensor, few_rows_w: torch.Tensor) -> torch.Tensor:
    """The product pdserve computes for ``x @ w^T`` (``Fp32WeightLinear`` / ``nn.Linear``), without the casts;
    ``few_rows_w`` is what the skinny kernel reads (``Fp32WeightLinear.few_rows_weight``, else ``w``)."""
    if cpu_linear.usable(x, w):
        return cpu_linear.skinny_linear(x, few_rows_w)
    return F.linear(x, w)


class Floor:
    """The matmul floor of a step of ``rows`` tokens of which ``sample_rows`` go through the LM head."""

    def __init__(self, model) -> None:
        self.weights = [(m.weight, getattr(m, "few_rows_weight", m.weight)) for m in _linears(model)]
        self.head = (model.lm_head.weight, getattr(model.lm_head, "few_rows_weight", model.lm_head.weight))
        self.inputs: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def flops(self, rows: int, sample_rows: int) -> float:
        return 2.0 * (rows * sum(w.numel() for w, _ in self.weights) + sample_rows * self.head[0].numel())

    def _x(self, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        key = (rows, k, dtype)
        if key not in self.inputs:
            self.inputs[key] = torch.randn(rows, k).to(dtype)
        return self.inputs[key]

    @torch.inference_mode()
    def run(self, rows: int, sample_rows: int) -> tuple[float, float]:
        """CPU-seconds and wall seconds of the step's linear layers alone."""
        c0, w0 = time.process_time(), time.perf_counter()
        for w, few in self.weights:
            _gemm(self._x(rows, w.shape[1], w.dtype), w, few)
        if sample_rows:
            _gemm(self._x(sample_rows, self.head[0].shape[1], self.head[0].dtype), *self.head)
        return time.process_time() - c0, time.perf_counter() - w0


class StepRecorder:
    """Records each step's (rows, sampling rows, prompt rows) from the model runner's input preparation."""

    def __init__(self, engine) -> None:
        self.shapes: list[tuple[int, int]] = []
        runner = engine.runner
        inner = runner.prepare_inputs

        def prepare_inputs(out):
            res = inner(out)
            self.shapes.append((res[0].numel(), len(res[3])))
            return res

        runner.prepare_inputs = prepare_inputs

    def last(self) -> tuple[int, int]:
        return self.shapes[-1]


def _timed_step(engine) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    engine.step()
    return time.process_time() - c0, time.perf_counter() - w0


def _add_batch(engine, batch: int, seed: int, prompt_range: tuple[int, int], max_tokens: int) -> list[str]:
    from pdserve.shared.protocol.sampling_params import SamplingParams

    rng = random.Random(seed)
    ids = []
    for i in range(batch):
        prompt = [rng.randrange(100, engine.vocab_size) for _ in range(rng.randint(*prompt_range))]
        rid = f"step-{seed}-{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        ids.append(rid)
    return ids


def _prefilling(engine) -> bool:
    return bool(engine.scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                                 for r in engine.scheduler.running)


def run_round(engine, floor: Floor, rec: StepRecorder, batch: int, seed: int, prompt_range, decode_steps: int,
              breakdown_steps: int = 0) -> dict:
    """One round at the current thread count: the batch's prefill steps, then ``decode_steps`` decode steps, each
    step followed by its floor, then ``breakdown_steps`` decode steps timed by part (``breakdown``). Aborts the
    batch at the end."""
    ids = _add_batch(engine, batch, seed, prompt_range, decode_steps + breakdown_steps + 8)
    prefill, decode = [], []
    try:
        while _prefilling(engine):
            before = engine.get_stats().prompt_tokens_computed
            cpu, wall = _timed_step(engine)
            rows, sample = rec.last()
            prompt = engine.get_stats().prompt_tokens_computed - before
            fcpu, fwall = floor.run(rows, sample)
            prefill.append({"rows": rows, "sample_rows": sample, "prompt_tokens": prompt, "cpu": cpu, "wall": wall,
                            "floor_cpu": fcpu, "floor_wall": fwall, "flops": floor.flops(rows, sample)})
        for _ in range(decode_steps):
            cpu, wall = _timed_step(engine)
            rows, sample = rec.last()
            fcpu, fwall = floor.run(rows, sample)
            decode.append({"rows": rows, "sample_rows": sample, "cpu": cpu, "wall": wall, "floor_cpu": fcpu,
                           "floor_wall": fwall, "flops": floor.flops(rows, sample)})
        parts = breakdown(engine, breakdown_steps) if breakdown_steps else None
    finally:
        for rid in ids:
            engine.abort_request(rid)
    return {"prefill": prefill, "decode": decode, "breakdown": parts}


class PartTimer:
    """Exclusive CPU-seconds per part of a step: wrappers that pause the enclosing part while an inner one runs."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []  # [label, start of its current exclusive stretch]

    def wrap(self, label, fn):
        def wrapped(*args, **kwargs):
            now = time.process_time()
            if self.stack:
                top = self.stack[-1]
                self.cpu[top[0]] = self.cpu.get(top[0], 0.0) + now - top[1]
            name = label(self.stack) if callable(label) else label
            self.stack.append([name, now])
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.process_time()
                top = self.stack.pop()
                self.cpu[top[0]] = self.cpu.get(top[0], 0.0) + end - top[1]
                self.calls[top[0]] = self.calls.get(top[0], 0) + 1
                if self.stack:
                    self.stack[-1][1] = end

        return wrapped


def _gemm_label(stack) -> str:
    return "matmul: LM head" if any(s[0] == "LM head: casts, Python" for s in stack) else "matmul: projections"


@contextlib.contextmanager
def _patched(targets):
    """Set ``(obj, name, value)`` attributes for the block, then put the old ones back."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in targets]
    for obj, name, value in targets:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old in saved:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def breakdown(engine, steps: int) -> dict:
    """Exclusive CPU-ms per part of the next ``steps`` steps of the running batch, per step."""
    from pdserve.shared.models import llama

    t = PartTimer()
    backend, model, sched = engine.backend, engine.model, engine.scheduler
    from pdserve.kernels.linear_choice import ChosenLinear

    fp32_cls = llama.Fp32WeightLinear
    targets = [
        (cpu_linear, "skinny_linear", t.wrap(_gemm_label, cpu_linear.skinny_linear)),
        (cpu_linear, "skinny_linear_dpbf16", t.wrap(_gemm_label, cpu_linear.skinny_linear_dpbf16)),
        (ChosenLinear, "forward", t.wrap("projections: casts, Python", ChosenLinear.forward)),
        (F, "linear", t.wrap(_gemm_label, F.linear)),
        (fp32_cls, "forward", t.wrap("projections: casts, Python", fp32_cls.forward)),
        (fp32_cls, "forward_f32", t.wrap("projections: casts, Python", fp32_cls.forward_f32)),
        (model.lm_head, "forward", t.wrap("LM head: casts, Python", model.lm_head.forward)),
        (backend, "forward", t.wrap("attention kernel", backend.forward)),
        (backend, "reshape_and_cache", t.wrap("KV cache write", backend.reshape_and_cache)),
        (cpu_elementwise, "add_rms_norm", t.wrap("element-wise: add+RMSNorm", cpu_elementwise.add_rms_norm)),
        (cpu_elementwise, "rope_", t.wrap("element-wise: RoPE", cpu_elementwise.rope_)),
        (cpu_elementwise, "silu_mul", t.wrap("element-wise: SiLU*up", cpu_elementwise.silu_mul)),
        (model.embed_tokens, "forward", t.wrap("embedding", model.embed_tokens.forward)),
        (model, "forward", t.wrap("model forward: Python, other ops", model.forward)),
        (engine.runner, "prepare_inputs", t.wrap("input preparation", engine.runner.prepare_inputs)),
        (engine, "_sample", t.wrap("sampling", engine._sample)),
        (engine, "_append_token", t.wrap("output processing", engine._append_token)),
        (engine.output, "take_outputs", t.wrap("output processing", engine.output.take_outputs)),
        (sched, "schedule", t.wrap("scheduler", sched.schedule)),
        (sched, "update_after_step", t.wrap("scheduler", sched.update_after_step)),
    ]
    total = 0.0
    with _patched(targets):
        for _ in range(steps):
            total += _timed_step(engine)[0]
    parts = {k: 1e3 * v / steps for k, v in sorted(t.cpu.items(), key=lambda kv: -kv[1])}
    parts["engine.step: the rest"] = 1e3 * total / steps - sum(parts.values())
    return {"step_cpu_ms": 1e3 * total / steps, "parts_cpu_ms": parts}


def summarize(rounds: list[dict]) -> dict:
    dec = [s for r in rounds for s in r["decode"]]
    pre = [s for r in rounds for s in r["prefill"]]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    d = {"steps": len(dec), "rows": dec[0]["rows"] if dec else 0,
         "cpu_ms": 1e3 * med([s["cpu"] for s in dec]), "wall_ms": 1e3 * med([s["wall"] for s in dec]),
         "floor_cpu_ms": 1e3 * med([s["floor_cpu"] for s in dec]), "floor_wall_ms": 1e3 * med([s["floor_wall"] for s in dec]),
         "gflop": dec[0]["flops"] / 1e9 if dec else 0.0}
    d["ratio_cpu"] = d["cpu_ms"] / d["floor_cpu_ms"]
    d["ratio_wall"] = d["wall_ms"] / d["floor_wall_ms"]
    d["floor_gflop_per_cpu_s"] = d["gflop"] / d["floor_cpu_ms"] * 1e3
    per_round = [(sum(s["prompt_tokens"] for s in r["prefill"]), sum(s["cpu"] for s in r["prefill"]),
                  sum(s["floor_cpu"] for s in r["prefill"]), sum(s["wall"] for s in r["prefill"]),
                  sum(s["flops"] for s in r["prefill"])) for r in rounds]
    tok, cpu, fcpu, wall, flops = (sum(x[i] for x in per_round) for i in range(5))
    p = {"steps_per_round": len(pre) // max(1, len(rounds)), "prompt_tokens": tok // max(1, len(rounds)),
         "tok_per_cpu_s": tok / cpu, "tok_per_s": tok / wall, "bound_tok_per_cpu_s": tok / fcpu,
         "share_of_bound": fcpu / cpu, "share_by_round": [x[2] / x[1] for x in per_round],
         "floor_gflop_per_cpu_s": flops / fcpu / 1e9}
    return {"decode": d, "prefill": p}


def _print_summary(threads: int, s: dict, batch: int) -> None:
    d, p = s["decode"], s["prefill"]
    click.echo(f"threads {threads}:")
    click.echo(f"  decode step, batch {batch} ({d['steps']} steps, {d['gflop']:.2f} GFLOP of linear layers): "
               f"{d['cpu_ms']:.1f} CPU-ms, {d['wall_ms']:.1f} wall-ms; floor {d['floor_cpu_ms']:.1f} CPU-ms "
               f"({d['floor_gflop_per_cpu_s']:.1f} GFLOP per CPU-s), {d['floor_wall_ms']:.1f} wall-ms -> "
               f"{d['ratio_cpu']:.2f}x the floor in CPU ({d['ratio_wall']:.2f}x wall; target <= 1.5x)")
    click.echo(f"  prefill ({p['prompt_tokens']} prompt tokens in {p['steps_per_round']} steps): "
               f"{p['tok_per_cpu_s']:.0f} prompt tok per CPU-s ({p['tok_per_s']:.0f} tok/s) vs bound "
               f"{p['bound_tok_per_cpu_s']:.0f} ({p['floor_gflop_per_cpu_s']:.1f} GFLOP per CPU-s) -> "
               f"{100 * p['share_of_bound']:.0f}% of the matmul bound (rounds: "
               f"{', '.join(f'{100 * x:.0f}%' for x in p['share_by_round'])}; target >= 60%)")


@click.command("step")
@click.option("--batch", default=32, show_default=True, help="Requests in the batch (decode step rows).")
@click.option("--threads", "threads_list", default="1,2", show_default=True, help="Thread counts, run in turns.")
@click.option("--rounds", default=3, show_default=True, help="Rounds; each runs every thread count once.")
@click.option("--decode-steps", default=6, show_default=True, help="Decode steps measured per round.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]))
@click.option("--prompt-len", default="16-256", show_default=True, help="Prompt length range MIN-MAX (tokens).")
@click.option("--max-num-batched-tokens", default=2048, show_default=True, help="The engine's token budget per step.")
@click.option("--attention-backend", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "torch"]),
              help="torch: the reference (gathers + padded SDPA), for an A/B of the CPU kernel.")
@click.option("--breakdown-steps", default=4, show_default=True, help="Decode steps timed by part (0: none).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def step_command(batch, threads_list, rounds, decode_steps, dtype, prompt_len, max_num_batched_tokens,
                 attention_backend, breakdown_steps, json_out) -> None:
    """A decode step and a prefill against their matmul floor, 1 and 2 threads in turns.

    The other CPU fast paths are switched off for an A/B with the engine's own variables: PDSERVE_FUSED_CPU=0,
    PDSERVE_SKINNY_LINEAR=0, PDSERVE_CPU_LINEAR=bf16|fp32|skinny (a bf16 model's projections forced onto one CPU
    product instead of the measured choice per shape)."""
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.llm_engine import LLMEngine

    threads = [int(x) for x in threads_list.split(",")]
    lo, hi = (int(x) for x in prompt_len.split("-"))
    engine = LLMEngine(EngineConfig(model=MODEL, dtype=dtype, kv_cache_memory_bytes=1 << 30,
                                    enable_prefix_caching=False, max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_seqs=max(batch, 128), attention_backend=attention_backend))
    floor, rec = Floor(engine.model), StepRecorder(engine)
    linear = type(engine.model.lm_head).__name__
    click.echo(f"step: {MODEL} {dtype}, batch {batch}, prompts {lo}-{hi} tokens, budget {max_num_batched_tokens} "
               f"tokens per step, threads {threads} in turns x {rounds} rounds; linear path {linear} "
               f"(skinny kernel up to {cpu_linear.MAX_ROWS} rows: {cpu_linear.load() is not None}), attention "
               f"{engine.backend.name} (kernel built: {cpu_attention.load() is not None}), fused element-wise "
               f"{os.environ.get('PDSERVE_FUSED_CPU', '1') != '0'}; OMP_WAIT_POLICY="
               f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; load average {os.getloadavg()}")
    torch.set_num_threads(threads[0])
    run_round(engine, floor, rec, batch, -1, (16, 32), 2)  # warm-up: builds, first-touch, allocator
    results: dict[int, list[dict]] = {t: [] for t in threads}
    loads = []
    for r in range(rounds):
        order = threads if r % 2 == 0 else threads[::-1]  # A B B A: neither count always runs first
        for t in order:
            torch.set_num_threads(t)
            results[t].append(run_round(engine, floor, rec, batch, r, (lo, hi), decode_steps,
                                        breakdown_steps if r == rounds - 1 else 0))
            loads.append(os.getloadavg()[0])
    summaries = {t: summarize(results[t]) for t in threads}
    for t in threads:
        _print_summary(t, summaries[t], batch)
    parts = {t: results[t][-1]["breakdown"] for t in threads if breakdown_steps}
    for t in parts:
        click.echo(f"where a decode step goes, {t} thread(s), exclusive CPU-ms per step (timed steps, "
                   f"{parts[t]['step_cpu_ms']:.1f} CPU-ms):")
        for name, ms in parts[t]["parts_cpu_ms"].items():
            click.echo(f"  {name:<36}{ms:8.1f}  {100 * ms / parts[t]['step_cpu_ms']:5.1f}%")
    click.echo(f"load average during the rounds: {min(loads):.1f}-{max(loads):.1f}; now {os.getloadavg()}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"summaries": summaries, "rounds": results, "breakdown": parts, "loads": loads,
                       "batch": batch, "dtype": dtype, "threads": threads}, f, indent=2)
