"""What the engine returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One candidate token at one position (vLLM's ``Logprob``): natural log, rank 1 = most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` completions. ``text`` and ``token_ids`` are cumulative;
    ``new_text`` and ``new_token_ids`` are what this step added (for streaming).

    ``logprobs``: per output position, ``{token_id: Logprob}`` with the sampled token and the top
    alternatives (``None`` when not asked). ``finish_reason``: ``"stop"`` | ``"length"`` |
    ``"abort"`` | ``None`` while running; ``stop_reason``: the stop string or stop token id that ended it.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One request's state after a step (vLLM's ``RequestOutput``). ``prompt_logprobs`` (when the request's
    ``SamplingParams.prompt_logprobs`` asked, else ``None``): one entry per prompt token, ``None`` for the
    first, then ``{token_id: Logprob}`` holding the prompt token and the ``k`` most likely tokens at that
    position (``decoded_token`` is left ``None``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
