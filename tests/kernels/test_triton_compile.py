"""The Triton kernels compile for Hopper (sm_90) and Ampere (sm_80) without a GPU.

The interpreter accepts programs the compiler rejects (dot shapes, dtype mixes, layouts), so the
interpreter tests alone would not show that the kernels build for a GPU. Triton compiles ahead of
time for a named target with its bundled ptxas; this checks every kernel, in bf16 and fp32, for the
default model's and a Llama-3-8B-like head layout, and that each fits in the target's shared memory.
It runs in a subprocess because this test session imports the kernels for the interpreter.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.slow

SHARED_MEMORY_BYTES = {90: 227 * 1024, 80: 163 * 1024}  # per block, opt-in maximum (CUDA guide)

_SCRIPT = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pdserve.kernels import triton_paged_attention_decode as dec
from pdserve.kernels import triton_paged_attention_prefill as pf
from pdserve.kernels import triton_reshape_and_cache as rc

arch, layouts = int(sys.argv[1]), json.loads(sys.argv[2])
TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

def build(fn, ptrs, consts, warps, stages):
    sig = {n: ("constexpr" if n in consts else ptrs.get(n, "fp32" if n == "scale_log2" else "i32")) for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return {"kernel": fn.__name__, "shared": k.metadata.shared}

out = []
for dtype in (torch.bfloat16, torch.float32):
    t = "*" + TY[dtype]
    for heads, kv_heads, head_dim, block_size in layouts:
        g = heads // kv_heads
        bd = max(16, triton.next_power_of_2(head_dim))
        io = {n: t for n in ("query_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        i32 = {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "seq_ids_ptr",
                                   "tile_seq_ptr", "tile_q0_ptr")}
        f32 = {n: "*fp32" for n in ("part_max_ptr", "part_sum_ptr", "part_acc_ptr")}
        c = dec.default_decode_config(dtype)
        out.append(build(dec._decode_partition_kernel, {**io, **i32, **f32}, dict(
            QUERIES_PER_KV=g, BLOCK_H=max(16, triton.next_power_of_2(g)), HEAD_DIM=head_dim, BLOCK_D=bd,
            BLOCK_N=c.block_n, BLOCK_SIZE=block_size, NUM_SPLITS=4, HAS_SEQ_IDS=True, FP32_DOT=dtype == torch.float32,
            HAS_WINDOW=dtype == torch.bfloat16),
            c.num_warps, c.num_stages))
        out.append(build(dec._decode_reduce_kernel, {**io, **i32, **f32}, dict(
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=4, BLOCK_S=4, HAS_SEQ_IDS=False), 1, 1))
        p = pf.default_prefill_config(dtype)
        gp = triton.next_power_of_2(g)
        bm = max(p.block_m, gp, 16)
        out.append(build(pf._prefill_kernel, {**io, **i32}, dict(
            QUERIES_PER_KV=g, GROUP_PAD=gp, BLOCK_Q=bm // gp, BLOCK_M=bm, HEAD_DIM=head_dim, BLOCK_D=bd,
            BLOCK_N=p.block_n, BLOCK_SIZE=block_size, FP32_DOT=dtype == torch.float32, HAS_WINDOW=dtype == torch.bfloat16),
            p.num_warps, p.num_stages))
        out.append(build(rc._reshape_and_cache_kernel, {"key_ptr": t, "value_ptr": t, "k_cache_ptr": t,
                   "v_cache_ptr": t, "slot_mapping_ptr": "*i64"}, dict(
            NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim)), 4, 1))
print(json.dumps(out))
"""


# (num_heads, num_kv_heads, head_dim, block_size): the default model's; a Llama-3-8B-like one
LAYOUTS = {90: [(9, 3, 64, 16), (32, 8, 128, 32)], 80: [(32, 8, 128, 16)]}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_for_gpu_targets_within_shared_memory(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(arch), json.dumps(LAYOUTS[arch])],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(built) == 2 * 4 * len(LAYOUTS[arch])  # 2 dtypes x 4 kernels per layout
    for k in built:
        assert k["shared"] <= SHARED_MEMORY_BYTES[arch], k
