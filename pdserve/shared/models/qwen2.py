"""Qwen2 (``Qwen2ForCausalLM``): the Llama layer with a bias on the Q/K/V projections."""

from __future__ import annotations

from pdserve.shared.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
