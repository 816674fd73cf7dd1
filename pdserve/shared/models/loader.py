"""Load a Llama-family checkpoint (HF directory with safetensors) into ``LlamaForCausalLM``.

Config and tokenizer come from ``transformers`` (``AutoConfig``, ``AutoTokenizer``); weights are read
tensor by tensor with ``safetensors`` and fused into our Q/K/V and gate/up layouts.
"""

from __future__ import annotations

import glob
import os

import torch

from pdserve.shared.models.llama import LlamaForCausalLM, native_low_precision_matmul
from pdserve.shared.models.tensor_parallel import TPShard, shard_weight

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def load_config(model_dir: str | os.PathLike):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return config


def load_model(model_dir, config, backend, dtype: torch.dtype, device: str, max_positions: int,
               tp: TPShard = TPShard()) -> LlamaForCausalLM:
    """The model with its weights; under tensor parallelism only rank ``tp.rank``'s slices (``shard_weight``)."""
    from safetensors import safe_open

    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions, tp)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    loaded: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                tensor = shard_weight(name, f.get_tensor(name), config, tp)
                target = name.removeprefix("model.")
                parts = target.split(".")
                # layers.N.self_attn.q_proj.weight -> layers.N.self_attn.qkv_proj.weight (piece 0)
                if len(parts) >= 3 and parts[-2] in fused:
                    fname, piece = fused[parts[-2]]
                    key = ".".join(parts[:-2] + [fname, parts[-1]])
                    pending.setdefault(key, {})[piece] = tensor
                    n_pieces = 3 if fname == "qkv_proj" else 2
                    if len(pending[key]) == n_pieces:
                        pieces = pending.pop(key)
                        cat = torch.cat([pieces[i] for i in range(n_pieces)], dim=0)
                        params[key].data.copy_(cat)
                        loaded.add(key)
                    continue
                if target not in params:
                    raise KeyError(f"unexpected weight {name} in {path}")
                params[target].data.copy_(tensor)
                loaded.add(target)
    if "lm_head.weight" not in loaded:  # tied embeddings (SmolLM2, Llama 3.2 1B/3B)
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing or pending:
        raise KeyError(f"checkpoint in {model_dir} lacks weights: {sorted(missing | set(pending))[:8]}")
    model.init_rope(dtype)
    if torch.device(device).type == "cpu" and (dtype == torch.float32 or (
            dtype in (torch.bfloat16, torch.float16) and not native_low_precision_matmul())):
        # fp32 models too: the wrapper shares their weights and sends few-row steps to cpu_linear
        model.use_fp32_matmul_weights()
    return model.eval()
