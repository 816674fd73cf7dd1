"""A request inside the engine: its tokens, how many are computed, and where it stands."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, overload

from pdserve.shared.protocol.block_hash import BlockHash, compute_block_hashes

if TYPE_CHECKING:
    import torch

    from pdserve.shared.protocol.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # recompute: blocks freed, num_computed_tokens reset
    SWAPPED = 3  # swap: blocks copied to the CPU pool
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class ConstantList(Sequence[int]):
    """A read-only view of a list (vLLM's ``ConstantList``): O(1) to hand out, no copy per access.

    It sees later appends to the list it wraps; take ``list(view)`` for a snapshot.
    """

    __slots__ = ("_x",)

    def __init__(self, x: list[int]) -> None:
        self._x = x

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i):
        return self._x[i]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self):
        return iter(self._x)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            other = other._x
        return self._x == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # a view of a mutable list

    def __repr__(self) -> str:
        return f"ConstantList({self._x!r})"


class Request:
    """One sequence. vLLM v1's rule: ``num_computed_tokens`` catches up with ``num_tokens``.

    ``all_token_ids`` = prompt + output (output tokens are also kept apart: ``output_token_ids`` is a
    read-only view of them, as in vLLM v1, so reading it every step costs nothing). A step schedules ``num_tokens - num_computed_tokens`` tokens
    (or a chunk of them); when they are all computed, the step samples the next token. Prefill,
    chunked prefill, prefix hits and recompute after preemption are the same rule.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "all_token_ids", "_output_token_ids", "sampling_params", "arrival_time",
        "priority",
        "cache_salt", "eos_token_ids", "num_computed_tokens", "status", "block_hashes", "num_cached_tokens",
        "generator", "max_tokens", "stop_reason", "num_preemptions", "parent_id", "index", "prefill_only",
        "first_token_time", "logprobs", "cumulative_logprob", "prompt_logprobs", "num_tokens_to_recompute",
        "spec_token_ids", "grammar",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        generator: torch.Generator | None = None,
        index: int = 0,
        parent_id: str | None = None,
        prefill_only: bool = False,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self._output_token_ids = list(output_token_ids)
        self.all_token_ids = self.prompt_token_ids + self._output_token_ids
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.generator = generator
        self.index = index
        self.parent_id = parent_id
        self.prefill_only = prefill_only
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        self.status = RequestStatus.WAITING
        self.block_hashes: list[BlockHash] = []
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # tokens whose KV a recompute preemption threw away: computing them again is recompute, not new work
        self.num_tokens_to_recompute = 0
        self.first_token_time: float | None = None
        # draft tokens proposed for the next step (speculative decoding); never part of all_token_ids
        self.spec_token_ids: list[int] = []
        # structured outputs: the sequence's RequestGrammar (structured_output.py), set by the engine
        self.grammar = None
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if sampling_params.logprobs is not None else None
        # per prompt position, filled as prefill chunks run; position 0 has no logprob (vLLM's None)
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> ConstantList:
        return ConstantList(self._output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of every full block of ``all_token_ids`` (computed incrementally)."""
        return compute_block_hashes(self.all_token_ids, block_size, self.cache_salt, self.block_hashes)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
