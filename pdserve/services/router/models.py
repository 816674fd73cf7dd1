"""The served model as clients name it: the ``model`` check every endpoint makes and the ``/v1/models`` card."""

from __future__ import annotations

from typing import Any

from .dispatch import Dispatcher
from .errors import OpenAIError


class ServedModel:
    """``name``: what clients send as ``model`` (``--served-model-name``); ``path``: ``--model``, also accepted;
    ``max_model_len``: the tokenizer side's context length (a decode pod's smaller KV cache lowers it)."""

    def __init__(self, name: str, path: str, max_model_len: int, created: int) -> None:
        self.name = name
        self.path = path
        self.max_model_len = max_model_len
        self.created = created

    def check(self, name: str | None) -> None:
        """404 ``OpenAIError`` unless ``name`` is None or names this model."""
        if name is not None and name not in (self.name, self.path):
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")

    async def card(self, dispatcher: Dispatcher) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's ``max_model_len``: the limit requests are held to now."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "root": self.path, "parent": None,
                "max_model_len": await dispatcher.context_limit(self.max_model_len), "permission": []}
