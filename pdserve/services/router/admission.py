"""Admission control: how many requests the router serves at once and how many of their choices may wait.

Admission counts what is not decoding yet: bounded queues keep admitted requests' latency bounded under
overload (the surplus is told to come back, 429 with Retry-After, instead of queueing without end). A choice
(prompt x n) counts as queued from its admission until it is decoding (``started_decoding``): not until its
first token, which a prefill pod samples before the KV hand-over waits for free blocks on the decode pod.
"""

from __future__ import annotations

from typing import Iterable

from . import errors
from .errors import OpenAIError


class Admission:
    """``max_concurrent_requests`` (requests between admission and release), ``max_queued_requests`` (choices
    not decoding yet), ``max_queued_prompt_tokens`` (their prompt tokens): 0 = no limit. ``retry_after_s``:
    the 429's Retry-After (at least 1 s)."""

    def __init__(self, max_concurrent_requests: int = 0, max_queued_requests: int = 0,
                 max_queued_prompt_tokens: int = 0, retry_after_s: int = 1) -> None:
        self.max_concurrent_requests = max_concurrent_requests
        self.max_queued_requests = max_queued_requests
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self.retry_after_s = retry_after_s
        self.active = 0  # requests between admit and release
        self.queued = 0  # admitted choices not decoding yet (in a queue, in prefill, or waiting for a decode slot)
        self.queued_tokens = 0  # their prompt tokens

    def check(self, prompt_lens: list[int], n: int) -> None:
        """Raise 429 when a limit is reached now, 400 when a request of ``len(prompt_lens)`` prompts x ``n``
        choices could never be admitted."""
        retry = {"Retry-After": str(max(self.retry_after_s, 1))}
        limit = self.max_concurrent_requests
        if limit and self.active >= limit:
            raise OpenAIError(429, f"The server is serving its limit of {limit} concurrent requests; retry later",
                              headers=retry)
        total, max_queued = len(prompt_lens) * n, self.max_queued_requests
        if max_queued and total > max_queued:  # could never be admitted: not worth a retry
            raise errors.bad_request(
                f"This request has {total} choices ({len(prompt_lens)} prompts x n={n}); the server queues "
                f"at most {max_queued} at once (--max-queued-requests): send fewer prompts or a smaller n",
                "prompt" if len(prompt_lens) > 1 else "n")
        if max_queued and self.queued + total > max_queued:
            raise OpenAIError(429, f"{self.queued} requests are waiting for prefill or a decode slot (limit "
                                   f"{max_queued}); retry later", headers=retry)
        max_tokens = self.max_queued_prompt_tokens
        if max_tokens and self.queued and self.queued_tokens + sum(prompt_lens) * n > max_tokens:
            raise OpenAIError(429, f"{self.queued_tokens} prompt tokens are waiting for prefill or a decode slot "
                                   f"(limit {max_tokens}); retry later", headers=retry)

    def admit(self, waiting: dict[int, int]) -> None:
        """Count one request whose choices ``waiting`` (choice index -> prompt tokens) are queued."""
        self.active += 1
        self.queued += len(waiting)
        self.queued_tokens += sum(waiting.values())

    def dequeue(self, waiting: dict[int, int], choices: Iterable[int] | None = None) -> None:
        """Stop counting ``choices`` (default: all) of ``waiting`` as queued; they leave ``waiting``."""
        for index in list(waiting) if choices is None else choices:
            tokens = waiting.pop(index, None)
            if tokens is not None:
                self.queued -= 1
                self.queued_tokens -= tokens

    def release(self, waiting: dict[int, int]) -> None:
        """The request ended: its choices still queued and the request itself stop counting."""
        self.dequeue(waiting)
        self.active -= 1
