"""A random 2-layer Llama (8 heads, 2 KV heads; ``heads=(6, 3)`` for one that splits over 3 ranks) saved as
safetensors with the default model's tokenizer: small enough to start several tensor-parallel ranks in a test, loaded
through the real loader."""

from __future__ import annotations

import os
import shutil


def make_tiny_llama(path, model_dir, max_position_embeddings: int = 256, heads: tuple[int, int] = (8, 2)) -> str:
    """``heads``: (attention heads, KV heads), 8 dimensions each; the MLP is twice the hidden size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=8 * heads[0], intermediate_size=16 * heads[0], num_hidden_layers=2,
                         num_attention_heads=heads[0], num_key_value_heads=heads[1], vocab_size=49152,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(model_dir, name), path)
    return str(path)
