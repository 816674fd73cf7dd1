"""Requests in: a prompt (and a resumed request's output) checked against the engine, then a ``Request``.

vLLM's ``InputProcessor``: the checks raise ``RequestRejected`` naming the parameter, with vLLM's wording so
clients that parse the messages keep working. A seeded request gets its own ``torch.Generator``; a request that
generated tokens elsewhere (resumed, or handed over) gets it advanced past them, so it samples what one engine
would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.shared.engine.request import Request
from pdserve.shared.engine.sampler import advance_generator
from pdserve.shared.protocol.sampling_params import SamplingParams, SamplingParamsError


class RequestRejected(ValueError):
    """A request that cannot be served (bad prompt, too long, can never fit). ``param`` names the input."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def eos_token_ids(model_config, tokenizer, model_dir: str) -> frozenset[int]:
    """Every EOS id the model's config, tokenizer and generation config name."""
    ids: set[int] = set()
    for source in (getattr(model_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids.update([gen] if isinstance(gen, int) else gen or [])
    except OSError:
        pass
    return frozenset(ids)


class InputProcessor:
    def __init__(self, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def validate_prompt(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Check a prompt; returns the effective ``max_tokens``. Raises ``RequestRejected``: empty prompt,
        token ids outside the vocabulary (in the prompt or in the logits processors' parameters), prompt
        (+ ``max_tokens``) beyond ``max_model_len``."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("The prompt cannot be empty.", "prompt")
        self.check_vocabulary(prompt_token_ids, "prompt")
        try:
            params.check_vocabulary(self.vocab_size)
        except SamplingParamsError as exc:
            raise RequestRejected(str(exc), exc.param) from exc
        if n >= self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"has {n} tokens, which leaves no room for output.", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). Please reduce "
                "the length of the prompt or the completion.", "max_tokens")
        return max_tokens

    def validate_output(self, output_token_ids: Sequence[int], params: SamplingParams, max_tokens: int) -> None:
        """Check the output a resumed request already has; raises ``RequestRejected``."""
        self.check_vocabulary(output_token_ids, "output_token_ids")
        if len(output_token_ids) >= max_tokens:
            raise RequestRejected(f"The request already has {len(output_token_ids)} of its {max_tokens} output "
                                  "tokens; nothing is left to generate.", "output_token_ids")
        if output_token_ids and params.n > 1:
            raise RequestRejected("A resumed request continues one completion; n must be 1.", "n")

    def check_vocabulary(self, token_ids: Sequence[int], param: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"Token id {bad} is out of vocabulary (vocab size {self.vocab_size}).", param)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None,
                 output_token_ids: Sequence[int] = ()) -> int:
        """Every check of a new request; returns its effective ``max_tokens``."""
        if cache_salt is not None and not cache_salt:
            # block hashes treat "" like no salt: it would share the unsalted tenants' prefix cache
            raise RequestRejected("cache_salt must be a non-empty string when given.", "cache_salt")
        max_tokens = self.validate_prompt(prompt_token_ids, params)
        self.validate_output(output_token_ids, params, max_tokens)
        return max_tokens

    def new_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, max_tokens: int,
                    *, arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    index: int = 0, parent_id: str | None = None, prefill_only: bool = False,
                    output_token_ids: Sequence[int] = ()) -> Request:
        """A ``Request`` (choice ``index`` of its user request); a seeded one samples from ``seed + index``."""
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator().manual_seed((params.seed + index) % 2**64)
        advance_generator(generator, len(output_token_ids), self.vocab_size)
        return Request(request_id, prompt_token_ids, params, max_tokens, self.eos_token_ids, arrival_time, priority,
                       cache_salt, generator, index, parent_id, prefill_only, output_token_ids=output_token_ids)
