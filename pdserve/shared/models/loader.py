"""Load a checkpoint (HF directory with safetensors) into the model class its config names (``registry``).

Config and tokenizer come from ``transformers`` (``AutoConfig``, ``AutoTokenizer``); weights are read
tensor by tensor with ``safetensors`` and handed to the model's ``load_weights``, which owns their names.
"""

from __future__ import annotations

import glob
import os

import torch

from pdserve.shared.models.llama import native_low_precision_matmul
from pdserve.shared.models.registry import architecture_of, model_class
from pdserve.shared.models.tensor_parallel import TPShard


def load_config(model_dir: str | os.PathLike):
    """The checkpoint's ``transformers`` config; raises ``ValueError`` when no registered class serves it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    architecture_of(config)
    return config


def load_model(model_dir, config, backend, dtype: torch.dtype, device: str, max_positions: int,
               tp: TPShard = TPShard()):
    """The model with its weights; under tensor parallelism only rank ``tp.rank``'s slices."""
    from safetensors import safe_open

    with torch.device("meta"):
        model = model_class(config)(config, backend, max_positions, tp)
    model = model.to_empty(device=device).to(dtype)
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")

    def weights():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    try:
        model.load_weights(weights())
    except KeyError as exc:
        raise KeyError(f"checkpoint in {model_dir}: {exc.args[0]}") from None
    model.init_rope(dtype)
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and dtype == torch.bfloat16:
        model.use_chosen_linears()  # per shape, measured: bf16 GEMMs, fp32 copies or the skinny kernel
    elif on_cpu and (dtype == torch.float32 or (dtype == torch.float16 and not native_low_precision_matmul())):
        # fp32 models too: the wrapper shares their weights and sends few-row steps to cpu_linear
        model.use_fp32_matmul_weights()
    return model.eval()
