"""Which class serves a checkpoint: its config's ``architectures`` (or, lacking them, ``model_type``) -> a model
class, vLLM's ``ModelRegistry`` in small. Adding an architecture is one file beside ``llama.py`` and one line here
(``docs/design.md`` "How to add a model")."""

from __future__ import annotations

import importlib

# architecture -> (module in pdserve.shared.models, class); imported when first used
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def architecture_of(config) -> str:
    """The supported architecture named by ``config.architectures`` (the first one supported), else by its
    ``model_type``; raises ``ValueError`` naming the supported ones."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in _MODELS:
            return name
    if not names and getattr(config, "model_type", None) in _MODEL_TYPES:
        return _MODEL_TYPES[config.model_type]
    given = names or [f"model_type {getattr(config, 'model_type', None)!r}"]
    raise ValueError(f"Model architectures {given} are not supported for now. Supported architectures: "
                     f"{supported_architectures()}")


def model_class(config):
    """The ``nn.Module`` class for ``config`` (see ``architecture_of``)."""
    module, cls = _MODELS[architecture_of(config)]
    return getattr(importlib.import_module(f"pdserve.shared.models.{module}"), cls)
