"""Mistral (``MistralForCausalLM``): the Llama layer; its ``sliding_window`` covers every layer
(``pdserve/shared/models/sliding_window.py``)."""

from __future__ import annotations

from pdserve.shared.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
