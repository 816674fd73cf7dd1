"""``/tokenize`` and ``/detokenize`` (vLLM's ``OpenAIServingTokenization`` shapes), over the router's tokenizer."""

from __future__ import annotations

from typing import Any

import anyio
from pydantic import BaseModel, ValidationError

from . import errors
from .dispatch import Dispatcher
from .models import ServedModel
from .prompts import PromptProcessor
from .schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest


def parse(model_cls: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` as ``model_cls``; its first validation error as a 400 ``OpenAIError`` naming the parameter."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        errs = exc.errors()
        message, param = errors.describe_validation_error({**errs[0], "loc": ("body", *errs[0]["loc"])})
        raise errors.bad_request(message, param) from exc


class TokenizationService:
    def __init__(self, processor: PromptProcessor, model: ServedModel, dispatcher: Dispatcher) -> None:
        self.processor = processor
        self.model = model
        self.dispatcher = dispatcher

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat (``messages``) or a prompt -> ``{count, max_model_len, tokens, token_strs}``."""
        processor = self.processor
        if "messages" in body:
            req = parse(TokenizeChatRequest, body)
            self.model.check(req.model)
            ids = await anyio.to_thread.run_sync(lambda: processor.chat_token_ids(
                req.messages, req.add_generation_prompt, req.continue_final_message,
                req.chat_template_kwargs, req.add_special_tokens))
        else:
            req = parse(TokenizeCompletionRequest, body)
            self.model.check(req.model)
            ids = await anyio.to_thread.run_sync(
                lambda: processor.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        # the limit requests are held to (a decode pod's smaller KV cache lowers it), as /v1/models reports it
        limit = await self.dispatcher.context_limit(processor.max_model_len)
        return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None}

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{tokens}`` -> ``{prompt}``; 400 for a token id outside the vocabulary."""
        req = parse(DetokenizeRequest, body)
        self.model.check(req.model)
        self.processor.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.processor.decode(req.tokens)}
