"""Benchmark of the Triton paged-attention kernels against the PyTorch reference and dense SDPA.

Usage (a CUDA machine; written for and unchanged on H100 / H200)::

    python -m pdserve.kernels.bench                      # correctness, timings, decode bandwidth, engine run
    python -m pdserve.kernels.bench --sweep              # + decode tile/launch-config sweep
    python -m pdserve.kernels.bench --no-engine --json out.json
    python -m pdserve.kernels.bench --cpu-smoke          # no GPU: small sizes in Triton's interpreter

Steps:
1. correctness: every kernel (and the triton backend on a mixed step) against ``attention_ref`` on
   random paged steps (scattered block ids, unowned blocks NaN-poisoned, outputs NaN-poisoned),
   ‖out − ref‖/‖ref‖ against a per-dtype tolerance; ``reshape_and_cache`` must be bit-exact.
2. timings: CUDA events around each call, L2 flushed before each, median of ``--iters`` runs after
   ``--warmup`` runs; triton vs the reference vs ``F.scaled_dot_product_attention`` over K/V already
   gathered into dense tensors (what a non-paged engine would run).
3. decode bandwidth: bytes of K and V read (sum of context lengths x kv heads x head_dim x 2 x
   element size) / time, next to the card's peak HBM bandwidth (vendor data sheets, table below) and
   the bandwidth of a 2 GiB device-to-device copy measured at start (``measure_copy_bandwidth``);
   the target is >= 70 % of the data sheet at batch 64 x 4,096-token contexts.
4. engine: ``pdserve.LLM`` with the default model, ``attention_backend="triton"`` and ``"torch"``,
   output tokens per second (skipped with a note if the engine cannot be imported or loaded).
Exit status 1 if any correctness check fails.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import click

# Peak HBM/GDDR bandwidth in bytes/s from NVIDIA's data sheets, matched on torch's device name
# (first match wins, so the more specific names come first).
PEAK_BANDWIDTH = [
    ("GH200", 4.0e12),
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H800", 3.35e12),
    ("H20", 4.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB parts
    ("A800", 2.039e12),
    ("L40S", 0.864e12),
    ("L40", 0.864e12),
    ("L4", 0.300e12),
    ("A10G", 0.600e12),
    ("A10", 0.600e12),
    ("RTX 6000 Ada", 0.960e12),
    ("RTX 4090", 1.008e12),
    ("RTX 3090", 0.936e12),
    ("T4", 0.320e12),
    ("V100", 0.900e12),
]

TOL = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2.5e-2}

# (name, num_heads, num_kv_heads, head_dim)
SHAPES = {
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}


def measure_copy_bandwidth(device: str, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Achievable memory bandwidth in bytes/s: a device-to-device copy of ``nbytes`` (read + write, so 2 x nbytes
    moved), median of ``iters`` runs timed with CUDA events after 3 warm-ups (a practical ceiling, usually 85-92 %
    of the data sheet's figure on HBM parts)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def peak_bandwidth(device_name: str) -> float | None:
    for key, peak in PEAK_BANDWIDTH:
        if key.lower() in device_name.lower():
            return peak
    return None


@dataclass
class Step:
    k_cache: object
    v_cache: object
    md: object
    key: object
    value: object
    query: object
    kv_tokens: int  # sum of context lengths (tokens whose K/V attention reads)


def make_step(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0, poison=True) -> Step:
    """A random step over ``seqs`` = [(cached tokens, query tokens), ...] with scattered blocks.

    The cache pool holds the sequences' blocks (filled with random K/V, which stands for the cached
    context), the null block 0 (zeros) and a few spare blocks (NaN when ``poison``).
    """
    import torch

    from pdserve.kernels.attention_metadata import AttentionMetadata

    torch.manual_seed(seed)
    nblk = [math.ceil((c + q) / block_size) for c, q in seqs]
    num_blocks = 1 + sum(nblk) + 8
    ids = torch.randperm(num_blocks - 1)[: sum(nblk)] + 1
    tables = torch.zeros(len(seqs), max(nblk), dtype=torch.int32)
    for i, t in enumerate(ids.split(nblk)):
        tables[i, : len(t)] = t.to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    if poison:
        unowned = torch.ones(num_blocks, dtype=torch.bool)
        unowned[ids] = False
        unowned = unowned.to(device)
        k_cache[unowned] = float("nan")
        v_cache[unowned] = float("nan")
    k_cache[0] = 0
    v_cache[0] = 0
    q_lens = [q for _, q in seqs]
    seq_lens = [c + q for c, q in seqs]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1]
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(q_lens))
    pos = torch.arange(num_tokens) - torch.tensor(qsl[:-1])[seq_of] + torch.tensor([c for c, _ in seqs])[seq_of]
    slots = tables[seq_of, pos // block_size].long() * block_size + pos % block_size
    md = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return Step(
        k_cache, v_cache, md,
        torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device),
        torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device),
        torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device),
        sum(seq_lens),
    )


def fresh(md):
    """The same metadata with an empty per-step cache."""
    from pdserve.kernels.attention_metadata import AttentionMetadata

    return AttentionMetadata(md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc,
                             list(md.query_lens_cpu), list(md.seq_lens_cpu), md.block_size)


class Timer:
    """Median milliseconds of ``fn()``: CUDA events on a GPU (L2 flushed before each run), else wall clock."""

    def __init__(self, device: str, warmup: int, iters: int) -> None:
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")
        self.warmup, self.iters = warmup, iters
        # bigger than any L2 (H100 50 MB, H200 60 MB, B200 126 MB)
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if self.cuda else None

    def __call__(self, fn) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.iters)]
            for start, end in events:
                self.flush.zero_()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in events]
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def gathered(step, seq_ids):
    """Dense K/V [n, kv_heads, max_len, head_dim] of ``seq_ids`` (all the same length) from the pages."""
    import torch

    md = step.md
    length = md.seq_lens_cpu[seq_ids[0]]
    assert all(md.seq_lens_cpu[s] == length for s in seq_ids), "dense baseline wants equal lengths"
    bs = md.block_size
    pos = torch.arange(length, device=step.k_cache.device)
    tables = md.block_tables[torch.tensor(seq_ids, device=pos.device)].long()
    slots = tables[:, pos // bs] * bs + pos % bs
    hkv, d = step.k_cache.shape[2], step.k_cache.shape[3]
    k = step.k_cache.view(-1, hkv, d)[slots].transpose(1, 2).contiguous()
    v = step.v_cache.view(-1, hkv, d)[slots].transpose(1, 2).contiguous()
    return k, v


# ------------------------------------------------------------------------------------------- checks


def correctness(sizes, dtype, device, block_size) -> list[dict]:
    import torch

    from pdserve.kernels.attention_ref import paged_attention_ref, reshape_and_cache_ref
    from pdserve.kernels.backend import TritonAttentionBackend
    from pdserve.kernels.triton_paged_attention_decode import paged_attention_decode
    from pdserve.kernels.triton_paged_attention_prefill import paged_attention_prefill
    from pdserve.kernels.triton_reshape_and_cache import reshape_and_cache

    dname = str(dtype).removeprefix("torch.")
    rows = []

    def record(kernel, case, err, tol):
        ok = err is not None and math.isfinite(err) and err <= tol
        rows.append({"kernel": kernel, "case": case, "rel_err": err, "tol": tol, "ok": ok})

    def rel(out, ref):
        if not torch.isfinite(out).all():
            return float("nan")
        return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

    backend = TritonAttentionBackend()
    for shape_name, (h, hkv, d) in SHAPES.items():
        long_ctx = sizes["check_context"]
        cases = {
            "decode": [(n - 1, 1) for n in (1, block_size, block_size + 1, 257, long_ctx, long_ctx // 2 + 3)],
            "prefill": [(0, sizes["check_chunk"]), (block_size + 5, sizes["check_chunk"] // 2 + 1), (2 * block_size, block_size), (7, 1)],
            "mixed": [(long_ctx - 1, 1), (0, 33), (block_size * 3 + 1, 1), (40, 17)],
        }
        for kind, seqs in cases.items():
            step = make_step(seqs, h, hkv, d, block_size, dtype, device, seed=len(rows))
            want_k, want_v = step.k_cache.clone(), step.v_cache.clone()
            reshape_and_cache_ref(step.key, step.value, want_k, want_v, step.md.slot_mapping)
            reshape_and_cache(step.key, step.value, step.k_cache, step.v_cache, step.md.slot_mapping)
            exact = torch.equal(step.k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0)) and torch.equal(
                step.v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))
            record("reshape_and_cache", f"{shape_name} {kind}", 0.0 if exact else float("inf"), 0.0)
            scale = d**-0.5
            ref = paged_attention_ref(step.query, want_k, want_v, fresh(step.md), scale)
            if kind == "decode":
                for splits in (1, None):
                    out = torch.full_like(step.query, float("nan"))
                    paged_attention_decode(step.query, step.k_cache, step.v_cache, fresh(step.md), scale, out=out, num_splits=splits)
                    record("paged_attention_decode", f"{shape_name} splits={splits or 'auto'}", rel(out, ref), TOL[dname])
            if kind == "prefill":
                out = torch.full_like(step.query, float("nan"))
                paged_attention_prefill(step.query, step.k_cache, step.v_cache, fresh(step.md), scale, out=out)
                record("paged_attention_prefill", f"{shape_name} chunks+prefix", rel(out, ref), TOL[dname])
            if kind == "mixed":
                out = backend.forward(step.query, step.k_cache, step.v_cache, fresh(step.md), scale)
                record("triton backend", f"{shape_name} decodes+chunks", rel(out, ref), TOL[dname])
    return rows


# ------------------------------------------------------------------------------------------- timings


def timings(sizes, dtype, device, block_size, timer, peak) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pdserve.kernels.attention_ref import paged_attention_ref, reshape_and_cache_ref
    from pdserve.kernels.triton_paged_attention_decode import choose_num_splits, paged_attention_decode
    from pdserve.kernels.triton_paged_attention_prefill import paged_attention_prefill
    from pdserve.kernels.triton_reshape_and_cache import reshape_and_cache

    rows = []
    el = torch.tensor([], dtype=dtype).element_size()
    for shape_name, (h, hkv, d) in SHAPES.items():
        scale = d**-0.5
        # decode: batch x context, every sequence the same length so dense SDPA needs no mask
        b, ctx = sizes["batch"], sizes["context"]
        step = make_step([(ctx - 1, 1)] * b, h, hkv, d, block_size, dtype, device, poison=False)
        md = step.md
        kv_bytes = step.kv_tokens * hkv * d * 2 * el
        k_dense, v_dense = gathered(step, list(range(b)))
        q4 = step.query.view(b, h, 1, d)
        splits = choose_num_splits(ctx, b, hkv, torch.device(device))
        t_triton = timer(lambda: paged_attention_decode(step.query, step.k_cache, step.v_cache, md, scale))
        t_ref = timer(lambda: paged_attention_ref(step.query, step.k_cache, step.v_cache, md, scale))
        t_sdpa = timer(lambda: F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=hkv != h))
        rows.append(_row("decode", shape_name, f"batch {b} x ctx {ctx}, splits {splits}", t_triton, t_ref, t_sdpa,
                         bytes_=kv_bytes, peak=peak))
        k_dense = v_dense = None  # free before the next case

        # prefill: fresh prompts (causal), then chunks after a cached prefix that ends mid-block
        for label, seqs in (
            ("fresh", [(0, sizes["prefill_len"])] * sizes["prefill_batch"]),
            ("after prefix", [(sizes["prefill_len"] + 5, sizes["prefill_len"] // 4)] * sizes["prefill_batch"]),
        ):
            step = make_step(seqs, h, hkv, d, block_size, dtype, device, poison=False)
            md = step.md
            n, (c, q) = len(seqs), seqs[0]
            flops = 4 * h * d * n * (q * c + q * (q + 1) // 2)  # QK^T and PV over visible keys
            k_dense, v_dense = gathered(step, list(range(n)))
            q4 = step.query.view(n, q, h, d).transpose(1, 2)
            if c == 0:
                sdpa = lambda: F.scaled_dot_product_attention(q4, k_dense, v_dense, is_causal=True, scale=scale, enable_gqa=hkv != h)  # noqa: E731
            else:
                mask = torch.arange(c + q, device=device)[None, :] <= torch.arange(c, c + q, device=device)[:, None]
                sdpa = lambda: F.scaled_dot_product_attention(q4, k_dense, v_dense, attn_mask=mask, scale=scale, enable_gqa=hkv != h)  # noqa: E731
            t_triton = timer(lambda: paged_attention_prefill(step.query, step.k_cache, step.v_cache, md, scale))
            t_ref = timer(lambda: paged_attention_ref(step.query, step.k_cache, step.v_cache, md, scale))
            t_sdpa = timer(sdpa)
            rows.append(_row("prefill", shape_name, f"{n} x ({c} cached + {q} new) {label}", t_triton, t_ref, t_sdpa,
                             flops=flops))
            k_dense = v_dense = None

        # cache write: one step of prefill tokens
        step = make_step([(0, sizes["prefill_len"])] * sizes["prefill_batch"], h, hkv, d, block_size, dtype, device, poison=False)
        moved = 2 * 2 * step.key.numel() * el  # read K,V + write K,V
        sm = step.md.slot_mapping
        t_triton = timer(lambda: reshape_and_cache(step.key, step.value, step.k_cache, step.v_cache, sm))
        t_ref = timer(lambda: reshape_and_cache_ref(step.key, step.value, step.k_cache, step.v_cache, sm))
        rows.append(_row("reshape_and_cache", shape_name, f"{step.key.shape[0]} tokens", t_triton, t_ref, None,
                         bytes_=moved, peak=peak))
    return rows


def _row(op, shape, case, t_triton, t_ref, t_sdpa, bytes_=None, flops=None, peak=None) -> dict:
    row = {"op": op, "shape": shape, "case": case, "triton_ms": t_triton, "ref_ms": t_ref, "sdpa_ms": t_sdpa}
    if bytes_ is not None:
        row["triton_GBps"] = bytes_ / (t_triton * 1e-3) / 1e9
        row["sdpa_GBps"] = bytes_ / (t_sdpa * 1e-3) / 1e9 if t_sdpa else None
        row["peak_GBps"] = peak / 1e9 if peak else None
        row["pct_of_peak"] = 100 * row["triton_GBps"] * 1e9 / peak if peak else None
    if flops is not None:
        row["triton_TFLOPs"] = flops / (t_triton * 1e-3) / 1e12
        row["sdpa_TFLOPs"] = flops / (t_sdpa * 1e-3) / 1e12 if t_sdpa else None
    return row


def sweep_decode_configs(sizes, dtype, device, block_size, timer, peak) -> list[dict]:
    """Decode stage-1 launch configs x split counts on the main shape; best first."""
    import torch

    from pdserve.kernels.triton_paged_attention_decode import DecodeConfig, paged_attention_decode

    h, hkv, d = SHAPES["llama3-8b"]
    b, ctx = sizes["batch"], sizes["context"]
    step = make_step([(ctx - 1, 1)] * b, h, hkv, d, block_size, dtype, device, poison=False)
    el = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = step.kv_tokens * hkv * d * 2 * el
    rows = []
    for block_n in (16, 32, 64, 128):
        for num_warps in (2, 4, 8):
            for num_stages in (1, 2, 3, 4):
                for splits in (1, 2, 4, 8, 16):
                    cfg = DecodeConfig(block_n, num_warps, num_stages)
                    try:
                        t = timer(lambda: paged_attention_decode(step.query, step.k_cache, step.v_cache, step.md,
                                                                 d**-0.5, num_splits=splits, config=cfg))
                    except Exception as e:  # out of shared memory / registers for this config
                        print(f"  skip {cfg} splits={splits}: {type(e).__name__}", file=sys.stderr)
                        continue
                    gbps = kv_bytes / (t * 1e-3) / 1e9
                    rows.append({**asdict(cfg), "splits": splits, "ms": t, "GBps": gbps,
                                 "pct_of_peak": 100 * gbps * 1e9 / peak if peak else None})
    rows.sort(key=lambda r: r["ms"])
    return rows


# ------------------------------------------------------------------------------------------- engine


def engine_run(model: str, device: str, num_prompts: int, prompt_len: int, output_len: int, dtype: str) -> list[dict]:
    import torch

    try:
        from pdserve import LLM, SamplingParams
    except Exception as e:  # the engine is optional for the kernel benchmark
        print(f"engine: skipped ({type(e).__name__}: {e})")
        return []
    rows = []
    outputs = {}
    for backend in ("triton", "torch"):
        try:
            llm = LLM(model=model, attention_backend=backend, device=device, dtype=dtype,
                      kv_cache_memory_bytes="8GiB" if device.startswith("cuda") else "256MiB",
                      max_num_seqs=256, max_num_batched_tokens=8192)
            vocab = llm.llm_engine.vocab_size
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
            sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        except Exception as e:
            print(f"engine ({backend}): failed ({type(e).__name__}: {e})")
            continue
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
        rows.append({"backend": backend, "prompts": num_prompts, "prompt_len": prompt_len, "output_len": output_len,
                     "seconds": elapsed, "output_tok_per_s": out_tokens / elapsed,
                     "total_tok_per_s": (out_tokens + num_prompts * prompt_len) / elapsed})
        del llm
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if len(outputs) == 2:
        same = sum(a == b for a, b in zip(outputs["triton"], outputs["torch"]))
        print(f"engine: greedy outputs identical between backends for {same}/{num_prompts} prompts")
    return rows


# ------------------------------------------------------------------------------------------- output


def _fmt(v, spec=".3f"):
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and math.isfinite(v) and abs(v) < 0.01:
            return format(v, ".2e")
        return format(v, spec)
    return str(v)


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n{title}")
    if not rows:
        print("  (none)")
        return
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)))


@click.command()
@click.option("--cpu-smoke", is_flag=True, help="No GPU: small sizes, kernels in Triton's interpreter.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="KV/query dtype (default bfloat16 on GPU, float32 with --cpu-smoke).")
@click.option("--block-size", default=16, show_default=True)
@click.option("--batch", default=64, show_default=True, help="Decode batch.")
@click.option("--context", default=4096, show_default=True, help="Decode context length per sequence.")
@click.option("--warmup", default=10, show_default=True)
@click.option("--iters", default=100, show_default=True)
@click.option("--sweep", is_flag=True, help="Also time decode launch configs x split counts.")
@click.option("--engine/--no-engine", default=True, show_default=True, help="Engine throughput run (GPU only).")
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
@click.option("--engine-prompts", default=256, show_default=True)
@click.option("--engine-prompt-len", default=512, show_default=True)
@click.option("--engine-output-len", default=256, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write all results here.")
def main(cpu_smoke, dtype, block_size, batch, context, warmup, iters, sweep, engine, model, engine_prompts,
         engine_prompt_len, engine_output_len, json_path):
    """Check and time the Triton paged-attention kernels (see the module docstring)."""
    if cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    import torch
    import triton

    if cpu_smoke:
        device = "cpu"
        sizes = {"check_context": 300, "check_chunk": 40, "batch": 2, "context": 300,
                 "prefill_batch": 1, "prefill_len": 64}
        warmup, iters = 1, 2
    else:
        if not torch.cuda.is_available():
            raise click.ClickException("no CUDA device: run on a GPU machine, or use --cpu-smoke")
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise click.ClickException("unset TRITON_INTERPRET to benchmark on the GPU")
        device = "cuda"
        sizes = {"check_context": 4096, "check_chunk": 512, "batch": batch, "context": context,
                 "prefill_batch": 4, "prefill_len": 2048}
    dtype_name = dtype or ("float32" if cpu_smoke else "bfloat16")
    tdtype = getattr(torch, dtype_name)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    peak = peak_bandwidth(name) if device == "cuda" else None
    print(f"device: {name}; peak bandwidth: {f'{peak / 1e12:.2f} TB/s' if peak else 'unknown'}; "
          f"torch {torch.__version__}, triton {triton.__version__}; dtype {dtype_name}, block_size {block_size}")

    copy_bw = measure_copy_bandwidth(device) if device == "cuda" else None
    if copy_bw is not None:
        sheet = f" = {100 * copy_bw / peak:.0f}% of the data sheet's {peak / 1e12:.2f} TB/s" if peak else ""
        print(f"measured device-to-device copy bandwidth: {copy_bw / 1e12:.2f} TB/s{sheet}")
    results = {"device": name, "peak_bytes_per_s": peak, "copy_bytes_per_s": copy_bw, "dtype": dtype_name,
               "block_size": block_size}
    checks = correctness(sizes, tdtype, device, block_size)
    results["correctness"] = checks
    print_table("correctness vs attention_ref (rel_err = |out - ref| / |ref|)", checks,
                ["kernel", "case", "rel_err", "tol", "ok"])
    failed = [c for c in checks if not c["ok"]]

    timer = Timer(device, warmup, iters)
    times = timings(sizes, tdtype, device, block_size, timer, peak)
    results["timings"] = times
    for r in times:
        if copy_bw is not None and r.get("triton_GBps") is not None:
            r["pct_of_copy"] = 100 * r["triton_GBps"] * 1e9 / copy_bw
    print_table(f"timings (median of {iters} after {warmup} warm-up; ms)", times,
                ["op", "shape", "case", "triton_ms", "ref_ms", "sdpa_ms", "triton_GBps", "sdpa_GBps", "peak_GBps",
                 "pct_of_peak", "pct_of_copy", "triton_TFLOPs", "sdpa_TFLOPs"])
    for r in times:
        if r["op"] == "decode" and r.get("pct_of_peak") is not None:
            verdict = "meets" if r["pct_of_peak"] >= 70 else "below"
            print(f"decode {r['shape']} {r['case']}: {r['triton_GBps']:.0f} GB/s = {r['pct_of_peak']:.1f}% of "
                  f"{r['peak_GBps']:.0f} GB/s peak ({verdict} the 70% target)"
                  + (f", {r['pct_of_copy']:.1f}% of the measured copy" if copy_bw else ""))
        elif r["op"] == "reshape_and_cache" and copy_bw is not None:
            print(f"reshape_and_cache {r['shape']} {r['case']}: {r['triton_GBps']:.0f} GB/s = "
                  f"{r['pct_of_copy']:.1f}% of the measured copy")

    if sweep:
        rows = sweep_decode_configs(sizes, tdtype, device, block_size, timer, peak)
        results["sweep"] = rows
        print_table("decode config sweep, llama3-8b shape (best first)", rows[:15],
                    ["block_n", "num_warps", "num_stages", "splits", "ms", "GBps", "pct_of_peak"])

    if engine and not cpu_smoke:
        rows = engine_run(model, device, engine_prompts, engine_prompt_len, engine_output_len, dtype_name)
        results["engine"] = rows
        print_table(f"engine throughput ({model})", rows,
                    ["backend", "prompts", "prompt_len", "output_len", "seconds", "output_tok_per_s", "total_tok_per_s"])

    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2, default=str)
    if failed:
        print(f"\nFAILED: {len(failed)} correctness check(s)")
        sys.exit(1)
    print("\nall correctness checks passed")


if __name__ == "__main__":
    main()
