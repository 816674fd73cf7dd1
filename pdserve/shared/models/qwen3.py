"""Qwen3 (``Qwen3ForCausalLM``): the Llama layer with RMSNorm over each head of Q and K before RoPE
(``q_norm``, ``k_norm``: one ``[head_dim]`` weight each, whole on every tensor-parallel rank), no Q/K/V bias, and
``head_dim`` from the config (not ``hidden_size / num_attention_heads``). Source: transformers'
``modeling_qwen3.Qwen3Attention``."""

from __future__ import annotations

from pdserve.shared.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
