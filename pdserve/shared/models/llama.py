"""Llama-family forward pass over a paged KV cache (Llama 2/3, Mistral, Qwen2, SmolLM2).

The math is Hugging Face transformers' ``LlamaForCausalLM`` (RMSNorm in fp32, rotate-half RoPE from
transformers' own rotary module, SiLU-gated MLP), restructured the vLLM way: the batch is a flat list
of ``num_tokens`` tokens from many sequences, Q/K/V and gate/up projections are fused into one matmul
each, every layer writes its new K/V into the paged cache and attends through the block tables.
Subclasses (``qwen2.py``, ``mistral.py``, ``qwen3.py``) switch Q/K/V bias and Q/K norm on; sliding windows are masked
per layer (``sliding_window.py``).
On CPU (float32/bfloat16) the element-wise work runs in fused C kernels (``pdserve/kernels/cpu_elementwise.py``:
residual add + RMSNorm, RoPE in place, SiLU * up) unless ``PDSERVE_FUSED_CPU=0``; they round as the
PyTorch ops do. With fp32 weight copies (``Fp32WeightLinear``) those kernels also take the GEMMs' float32 output
and give them float32 input, rounding to the model's dtype where the casts they replace would (``f32_io``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_elementwise, cpu_linear
from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.shared.models.sliding_window import layer_sliding_windows
from pdserve.shared.models.tensor_parallel import SplitRule, TPShard, shard_weight


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order: normalise in fp32, cast back, then scale (matters for bf16 parity)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Fp32WeightLinear(nn.Module):
    """A bf16/fp16 ``nn.Linear`` computed with an fp32 copy of its weights: ``linear(x.float(), W32).to(x.dtype)``.

    On CPUs without native bf16 matrix instructions (no AVX512-BF16/AMX) oneDNN's bf16 GEMM converts and
    accumulates in fp32 anyway, 4-7x slower than an fp32 GEMM on the same shapes (measured on this
    project's AVX2 machine); the fp32 weights are the bf16 values exactly, so only the order of the fp32
    sums differs. Costs twice the weight memory. Up to ``cpu_linear.MAX_ROWS`` rows (decode and speculative
    verify steps at small batch) go through ``cpu_linear.skinny_linear``, which reads the weights once where
    MKL's sgemm repacks them per call, and sums each row as it would alone; for a bf16 layer it reads the layer's
    own bf16 weights, kept beside the copy (``few_rows_weight``; half the bytes of a step bound by reading them,
    the same bits out; ``PDSERVE_SKINNY_BF16=0`` drops them and reads the copy).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.weight = nn.Parameter(w.float(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.out_features = linear.out_features
        keep = w.dtype == torch.bfloat16 and w.is_contiguous() and cpu_linear.bf16_weights_enabled()
        self.few_rows_weight = w if keep else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_f32(x).to(x.dtype)

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, in] in any float dtype -> [M, out] float32, not rounded to the model's dtype (the fused CPU
        kernels round it where the cast would, in the same pass as their own work)."""
        if cpu_linear.usable(x, self.weight):
            return cpu_linear.skinny_linear(x, self.few_rows_weight, self.bias)
        return F.linear(x.float(), self.weight, self.bias)


def native_low_precision_matmul() -> bool:
    """Whether this CPU multiplies fp16 natively (AVX512-BF16 or AMX); ``PDSERVE_BF16_MATMUL=native|fp32``
    overrides. bf16 models choose per shape instead (``kernels/linear_choice.py``, ``PDSERVE_CPU_LINEAR``)."""
    choice = os.environ.get("PDSERVE_BF16_MATMUL")
    if choice in ("native", "fp32"):
        return choice == "native"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def add_rms_norm(fused: bool, residual: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``residual += delta`` in place (None: nothing to add), then ``norm(residual)``: the C kernel when ``fused``,
    else the PyTorch ops it equals (``out_dtype`` is the kernel's, see ``cpu_elementwise.add_rms_norm``)."""
    if fused:
        return cpu_elementwise.add_rms_norm(residual, delta, norm.weight, norm.eps, out_dtype)
    if delta is not None:
        residual += delta.to(residual.dtype)
    return norm(residual)


def rope_(fused: bool, x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate-half RoPE in place on ``x`` [T, heads, head_dim] (a view into the QKV projection's output)."""
    if fused:
        cpu_elementwise.rope_(x, cos_sin, positions)
        return
    cos = cos_sin[0, positions].unsqueeze(1)  # [T, 1, head_dim]
    sin = cos_sin[1, positions].unsqueeze(1)
    x.copy_(x * cos + rotate_half(x) * sin)


def silu_mul(fused: bool, gate_up: torch.Tensor, dtype=None, out_dtype=None) -> torch.Tensor:
    if fused:
        return cpu_elementwise.silu_mul(gate_up, dtype, out_dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaAttention(nn.Module):
    """Self-attention over the paged cache; under tensor parallelism (``tp``) this rank's query and KV heads
    only, its ``o_proj`` output summed over the ranks. ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3: RMSNorm over
    each head of Q and K before RoPE) come from the model class."""

    def __init__(self, config, backend, tp: TPShard = TPShard(), qkv_bias: bool = False, qk_norm: bool = False,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = tp.heads(config.num_attention_heads)[1]
        self.num_kv_heads = tp.kv_heads(config.num_key_value_heads)[1]
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = qkv_bias or bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend = backend

    def forward(self, x, cos_sin, positions, k_cache, v_cache, md: AttentionMetadata, fused: bool,
                f32_io: bool = False):
        """``x`` [T, hidden] -> [T, hidden], RoPE applied in place on the QKV projection's Q and K (one pass, no
        copies). ``f32_io`` (with ``fused``): ``x`` is float32 holding model-dtype values and the result is
        ``o_proj``'s float32 output, not rounded (``Fp32WeightLinear.forward_f32``; the fused kernels around it
        round as the casts would)."""
        t, hd = x.shape[0], self.head_dim
        qkv = self.qkv_proj.forward_f32(x).to(cos_sin.dtype) if f32_io else self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, hd)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm of Q and K, before RoPE
            qk[:, :self.num_heads] = self.q_norm(qk[:, :self.num_heads])
            qk[:, self.num_heads:] = self.k_norm(qk[:, self.num_heads:])
        rope_(fused, qk, cos_sin, positions)
        q = qkv[:, :self.q_size].view(t, self.num_heads, hd)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, hd)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, hd)
        self.backend.reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping)
        if self.sliding_window is None:
            o = self.backend.forward(q, k_cache, v_cache, md, self.scale)
        else:
            o = self.backend.forward(q, k_cache, v_cache, md, self.scale, self.sliding_window)
        o = o.reshape(t, self.q_size)
        return self.o_proj.forward_f32(o) if f32_io else self.tp.all_reduce(self.o_proj(o))


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TPShard = TPShard()) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate = config.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, backend, tp: TPShard = TPShard(), **attn) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, tp, **attn)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the fused path hands the fp32-weight GEMMs float32 in and out (set by use_fp32_matmul_weights; not under
        # tensor parallelism, whose all-reduce sums the rounded outputs)
        self.f32_io = False

    def forward(self, residual, delta, cos_sin, positions, k_cache, v_cache, md, fused: bool) -> torch.Tensor:
        """``residual`` [T, hidden] is updated in place with the previous layer's output ``delta`` (None for the
        first layer) and this layer's attention; returns this layer's MLP output, the next layer's ``delta``
        (vLLM's residual-passing form). ``fused``: the CPU element-wise kernels, else the PyTorch ops they equal."""
        mlp = self.mlp
        if self.f32_io and fused:  # no cast passes: the kernels round the GEMMs' float32 on load and write float32
            h = add_rms_norm(True, residual, delta, self.input_layernorm, torch.float32)
            a = self.self_attn(h, cos_sin, positions, k_cache, v_cache, md, True, True)
            h = add_rms_norm(True, residual, a, self.post_attention_layernorm, torch.float32)
            gu = mlp.gate_up_proj.forward_f32(h)
            return mlp.down_proj.forward_f32(silu_mul(True, gu, residual.dtype, torch.float32))
        h = add_rms_norm(fused, residual, delta, self.input_layernorm)
        a = self.self_attn(h, cos_sin, positions, k_cache, v_cache, md, fused)
        h = add_rms_norm(fused, residual, a, self.post_attention_layernorm)
        return mlp.tp.all_reduce(mlp.down_proj(silu_mul(fused, mlp.gate_up_proj(h))))


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def default_rope(config, theta: float, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin ``[1, P, head_dim]`` in ``dtype`` for ``position_ids [1, P]``: transformers 5's
    ``LlamaRotaryEmbedding`` of ``rope_type`` default, op for op (its ``compute_default_rope_parameters`` and
    ``forward``, whose attention scaling is 1.0 for this type)."""
    dim = head_dim_of(config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = position_ids[..., None].float() * inv_freq.to(dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype), emb.sin().to(dtype=dtype)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, kv_caches, md) -> hidden [T, hidden_size].

    ``kv_caches[l]`` is layer ``l``'s ``(k_cache, v_cache)``, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``. ``compute_logits(hidden [R, hidden_size])``
    returns ``[R, vocab_size]`` float32; the runner calls it only on the rows that sample.
    ``tp``: this rank's shard under tensor parallelism (``pdserve/shared/models/tensor_parallel.py``); then the KV caches
    hold this rank's KV heads only, and the embedding and LM head are whole on every rank.
    """

    qkv_bias = False  # Q/K/V projections with a bias (Qwen2); a config's ``attention_bias`` also turns it on
    qk_norm = False  # RMSNorm over each head of Q and K before RoPE (Qwen3)
    # checkpoint projections fused into one of ours, in order (vLLM's name)
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # how each checkpoint projection splits over tensor-parallel ranks (``tensor_parallel.shard_weight``): column-
    # parallel ones by output rows (dim 0), row-parallel ones by input columns (dim 1); anything else is whole
    tp_split_rules: dict[str, SplitRule] = {
        "q_proj": ("heads", 0), "k_proj": ("kv_heads", 0), "v_proj": ("kv_heads", 0), "o_proj": ("heads", 1),
        "gate_proj": ("intermediate", 0), "up_proj": ("intermediate", 0), "down_proj": ("intermediate", 1)}

    def __init__(self, config, backend, max_positions: int, tp: TPShard = TPShard()) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        # On the meta device (the loader's) the random init fills nothing, yet torch's meta ``normal_`` imports
        # torch._dynamo on first use: ~2.7 CPU-s of every engine process's start-up. ``_weight`` skips the init.
        meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size) if meta else None)
        windows = layer_sliding_windows(config)  # per layer: masked in attention, None for full attention
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, tp, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, sliding_window=w)
            for w in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.fused_cpu: bool | None = None  # the element-wise CPU kernels (pdserve/kernels/cpu_elementwise.py)

    def init_rope(self, dtype: torch.dtype) -> None:
        """Precompute cos/sin for every position with transformers' rotary module (all RoPE types); the plain RoPE of
        a transformers 5 config (``rope_parameters`` of type ``default``) with the same ops here, since importing
        ``modeling_llama`` costs every engine process ~1.5 CPU-s (tests/models/test_rope.py: bit-equal)."""
        pos = torch.arange(self.max_positions)[None]
        params = getattr(self.config, "rope_parameters", None) or {}
        if params.get("rope_type") == "default" and "rope_theta" in params:
            cos, sin = default_rope(self.config, params["rope_theta"], pos, dtype)
        else:
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            cos, sin = LlamaRotaryEmbedding(self.config)(torch.empty(0, dtype=dtype), pos)
        self.cos_sin = torch.stack([cos[0], sin[0]]).to(self.embed_tokens.weight.device).contiguous()

    def forward(self, input_ids, positions, kv_caches, md: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.fused_cpu is None:  # decided on the first step: CPU, float32/bfloat16, the kernels built
            self.fused_cpu = os.environ.get("PDSERVE_FUSED_CPU", "1") != "0" and cpu_elementwise.available(x) \
                and self.cos_sin.dtype == x.dtype == self.norm.weight.dtype and self.cos_sin.shape[-1] <= 512
        delta = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            delta = layer(x, delta, self.cos_sin, positions, k_cache, v_cache, md, self.fused_cpu)
        return add_rms_norm(self.fused_cpu, x, delta, self.norm)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF checkpoint tensors ``(name, tensor)`` into this model (this rank's slices under tensor
        parallelism): ``model.`` prefixes dropped, the ``packed_modules_mapping`` pieces concatenated, an absent
        ``lm_head`` tied to the embedding. Raises ``KeyError`` naming an unexpected or missing weight."""
        params = dict(self.named_parameters())
        piece_of = {part: (packed, i) for packed, parts in self.packed_modules_mapping.items()
                    for i, part in enumerate(parts)}
        loaded: set[str] = set()
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            parts = name.removeprefix("model.").split(".")
            leaf = parts[-2] if len(parts) >= 2 else ""
            tensor = shard_weight(tensor, self.tp_split_rules.get(leaf), self.config, self.tp)
            if leaf in piece_of:  # layers.N.self_attn.q_proj.weight -> layers.N.self_attn.qkv_proj.weight, piece 0
                packed, i = piece_of[leaf]
                key = ".".join(parts[:-2] + [packed, parts[-1]])
                pending.setdefault(key, {})[i] = tensor
                if len(pending[key]) < len(self.packed_modules_mapping[packed]):
                    continue
                pieces = pending.pop(key)
                tensor = torch.cat([pieces[j] for j in range(len(pieces))], dim=0)
            else:
                key = ".".join(parts)
            if key not in params:
                raise KeyError(f"unexpected weight {name}")
            params[key].data.copy_(tensor)
            loaded.add(key)
        if "lm_head.weight" not in loaded:  # tied embeddings (SmolLM2, Llama 3.2 1B/3B)
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        missing = set(params) - loaded
        if missing or pending:
            raise KeyError(f"checkpoint lacks weights: {sorted(missing | set(pending))[:8]}")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def use_chosen_linears(self) -> None:
        """Swap a bf16 model's projections and LM head for ``linear_choice.ChosenLinear`` (CPU; call after loading
        the weights): per shape and row count the fastest of bf16 GEMMs, fp32 weight copies and the skinny kernel."""
        from pdserve.kernels.linear_choice import ChosenLinear

        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = ChosenLinear(attn.qkv_proj), ChosenLinear(attn.o_proj)
            mlp.gate_up_proj, mlp.down_proj = ChosenLinear(mlp.gate_up_proj), ChosenLinear(mlp.down_proj)
        self.lm_head = ChosenLinear(self.lm_head)

    def use_fp32_matmul_weights(self) -> None:
        """Swap every projection and the LM head for ``Fp32WeightLinear`` (call after loading the weights);
        logits still round through the model dtype, as they would from a bf16 GEMM."""
        for layer in self.layers:
            layer.self_attn.qkv_proj = Fp32WeightLinear(layer.self_attn.qkv_proj)
            layer.self_attn.o_proj = Fp32WeightLinear(layer.self_attn.o_proj)
            layer.mlp.gate_up_proj = Fp32WeightLinear(layer.mlp.gate_up_proj)
            layer.mlp.down_proj = Fp32WeightLinear(layer.mlp.down_proj)
            layer.f32_io = self.tp.size == 1
        self.lm_head = Fp32WeightLinear(self.lm_head)
