"""The loader's RoPE tables (``LlamaForCausalLM.init_rope``): the plain RoPE computed in pdserve equals transformers'
``LlamaRotaryEmbedding`` bit for bit, and every other RoPE type still goes through transformers' module.

Oracle: transformers' ``LlamaRotaryEmbedding`` on the same config, compared with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.shared.models.llama import LlamaForCausalLM, default_rope

# imports transformers' modeling code (~5 s of CPU the fast tier never pays otherwise)
pytestmark = pytest.mark.slow


def transformers_rope(config, positions: int, dtype: torch.dtype):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config)(torch.empty(0, dtype=dtype), torch.arange(positions)[None])


def tables(config, positions: int, dtype: torch.dtype) -> torch.Tensor:
    with torch.device("meta"):
        model = LlamaForCausalLM(config, None, positions)
    model = model.to_empty(device="cpu")  # as the loader does
    model.init_rope(dtype)
    return model.cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_default_rope_equals_transformers_bit_for_bit(model_dir, dtype):
    from transformers import AutoConfig, Qwen2Config

    smollm2 = AutoConfig.from_pretrained(model_dir)  # head_dim 64, theta 100000
    qwen2 = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=1,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})  # head_dim 64
    for config in (smollm2, qwen2):
        assert config.rope_parameters["rope_type"] == "default"
        cos, sin = transformers_rope(config, 8192, dtype)
        got = default_rope(config, config.rope_parameters["rope_theta"], torch.arange(8192)[None], dtype)
        assert torch.equal(got[0], cos) and torch.equal(got[1], sin) and got[0].dtype == dtype
        assert torch.equal(tables(config, 8192, dtype), torch.stack([cos[0], sin[0]]))


def test_other_rope_types_use_transformers_module(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    cos, sin = transformers_rope(config, 4096, torch.float32)
    plain = default_rope(config, 500000.0, torch.arange(4096)[None], torch.float32)
    assert not torch.equal(plain[0], cos)  # the llama3 scaling changes the low frequencies
    assert torch.equal(tables(config, 4096, torch.float32), torch.stack([cos[0], sin[0]]))
