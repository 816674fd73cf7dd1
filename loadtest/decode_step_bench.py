"""Decode-step A/B of the CPU fast paths: one step of 32 sequences (contexts 16-380), SmolLM2-135M shapes,
random weights, bf16; CPU-ms and wall-ms per step for each variant, measured in turns in one process.

    python -m pdserve.loadtest.decode_step_bench 1        # threads; VARIANTS=name,name to pick
"""

import os, random, sys, time, torch
from transformers import AutoConfig
from pdserve.shared.models.resolve import resolve_model
from pdserve.shared.models.llama import LlamaForCausalLM
from pdserve.kernels.backend import get_attention_backend
from pdserve.kernels.attention_metadata import AttentionMetadata


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]))
    cfg = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct"))
    dt = torch.bfloat16
    random.seed(0)
    ctx = [random.randint(16, 380) for _ in range(32)]
    bs, hd = 16, cfg.hidden_size // cfg.num_attention_heads
    nblk = sum(-(-c // bs) for c in ctx) + 1
    tables, nxt = [], 1
    for c in ctx:
        n = -(-c // bs); tables.append(list(range(nxt, nxt + n))); nxt += n
    width = max(len(t) for t in tables)
    kv = [(torch.randn(nblk, bs, cfg.num_key_value_heads, hd).to(dt), torch.randn(nblk, bs, cfg.num_key_value_heads, hd).to(dt)) for _ in range(cfg.num_hidden_layers)]
    def md():
        m = AttentionMetadata(slot_mapping=torch.tensor([t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(tables, ctx)]),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            seq_lens=torch.tensor(ctx, dtype=torch.int32), query_start_loc=torch.arange(33, dtype=torch.int32),
            query_lens_cpu=[1] * 32, seq_lens_cpu=list(ctx), block_size=bs)
        m.cache["qsl"] = list(range(33)); return m
    ids = torch.randint(0, 1000, (32,)); pos = torch.tensor([c - 1 for c in ctx])
    models = {}
    VARS = [("ref-attn+unfused", "torch", False), ("cpu-attn+unfused", "cpu", False), ("cpu-attn+fused", "cpu", True), ("cpu-attn+fused+fp32w", "cpu", True), ("cpu-attn+unfused+fp32w", "cpu", False)]
    for name, backend, fused in [v for v in VARS if v[0] in os.environ.get("VARIANTS", ",".join(x[0] for x in VARS)).split(",")]:
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg, get_attention_backend(backend), 1024).to(dt).eval(); m.init_rope(dt); m.fused_cpu = fused
        if "fp32w" in name: m.use_fp32_matmul_weights()
        models[name] = m
    res = {}
    with torch.inference_mode():
        outs = {n: m(ids, pos, kv, md()) for n, m in models.items()}
        for rnd in range(4):
            for n, m in models.items():
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(3): m(ids, pos, kv, md())
                res.setdefault(n, []).append(((time.process_time() - c0) / 3 * 1e3, (time.perf_counter() - w0) / 3 * 1e3))
    base = next(iter(outs.values())).float()
    for n in models:
        print(f"{n:<18} best CPU-ms/step {min(r[0] for r in res[n]):7.1f}  median {sorted(r[0] for r in res[n])[2]:7.1f}  wall {min(r[1] for r in res[n]):7.1f}  max|diff| vs ref {(outs[n].float() - base).abs().max().item():.3g}")
    print("threads", sys.argv[1], "load", os.getloadavg())



if __name__ == "__main__":
    main()
