"""Logits processors: one sampling parameter each, applied by the sampler to the rows of the requests that use it.

A processor class is built for one step from the batch's ``SamplingParams`` (``from_batch``), and only when at
least one row uses it: the common request, which uses none, costs one scan of the params per class and no
tensor work. ``apply`` transforms the float32 logits rows of the requests it applies to and leaves the others
alone. vLLM v1's names and order (``vllm/v1/sample/sampler.py``), with two kinds:

* not argmax-invariant (they change greedy output), on every row's raw float32 logits, before penalties, in
  this order: ``GrammarBitmaskLogitsProcessor`` (structured outputs, as vLLM's grammar bitmask before the
  sampler), ``AllowedTokenIdsLogitsProcessor``, ``BadWordsLogitsProcessor``, ``MinTokensLogitsProcessor``,
  ``LogitBiasLogitsProcessor``;
* argmax-invariant (they only narrow a random draw), on the random rows' temperature-scaled logits, before
  top-k and top-p: ``MinPLogitsProcessor``.

pdserve's sampler rebuilds its metadata every step (there is no persistent batch), so where vLLM hands a
processor ``BatchUpdate`` diffs (added, removed, moved rows), here ``from_batch`` sees the step's rows whole.
To add a sampling parameter: a field on ``SamplingParams`` (validated, in its wire rule), one class here, one
line in ``LOGITS_PROCESSORS`` (docs/design.md "How to add a sampling parameter").
"""

from __future__ import annotations

import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pdserve.shared.protocol.sampling_params import SamplingParams


@dataclass(slots=True)
class ProcessorBatch:
    """What a processor may read about the step's rows: row ``i`` is ``params[i]`` with ``output_token_ids[i]``
    generated so far (a speculative verify row counts the drafts before it) and ``grammars[i]`` its
    ``structured_output.RequestGrammar`` (empty, or ``None`` per row, without structured outputs)."""

    params: Sequence[SamplingParams]
    output_token_ids: Sequence[Sequence[int]]
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    device: torch.device | str
    grammars: Sequence[Any] = ()


class LogitsProcessor(ABC):
    """One sampling parameter's transformation of the logits rows that use it (vLLM v1's ``LogitsProcessor``)."""

    # True: cannot change the argmax, so greedy rows skip it and it runs after temperature on random rows.
    argmax_invariant: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_batch(cls, batch: ProcessorBatch) -> LogitsProcessor | None:
        """The processor for this step's rows, or ``None`` when no row uses it."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits``: float32 ``[len(batch.params), vocab]``. Not argmax-invariant processors write in place
        (the sampler's own copy); argmax-invariant ones return a new tensor."""


def _masked_pairs(rows: list[int], ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device))


class GrammarBitmaskLogitsProcessor(LogitsProcessor):
    """``structured_outputs``: tokens the row's grammar does not allow next get ``-inf``. Each matcher is first
    synced to the row's output tokens (the replay rule of ``structured_output.py``; a verify row's drafts count),
    then fills its row of an xgrammar bitmask (one bit per token).

    Only the grammar rows are filled, into one buffer reused across steps (per thread: an engine owns its
    thread), and the bits become an additive ``0``/``-inf`` mask through a 256-entry byte table (each bitmask
    byte gathers its 8 mask values), added in place. Measured in turns on this 2-core host at batch 32 x 49152
    (pdserve/loadtest/README.md "Structured outputs"): ~1-4 ms CPU a step, where a fresh bitmask each step and
    xgrammar's CPU kernel cost 3-17 ms."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor) -> None:
        self.rows, self.bitmask = rows, bitmask  # bitmask: [len(rows), ceil(vocab / 32)] int32, row j is rows[j]

    @classmethod
    def from_batch(cls, batch: ProcessorBatch) -> GrammarBitmaskLogitsProcessor | None:
        rows = [i for i, g in enumerate(batch.grammars) if g is not None]
        if not rows:
            return None
        bitmask = _bitmask_buffer(len(rows), batch.vocab_size)
        for j, i in enumerate(rows):
            grammar = batch.grammars[i]
            reachable = grammar.sync(batch.output_token_ids[i], strict=False)
            grammar.fill_bitmask(bitmask, j, reachable)
        return cls(rows, bitmask)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        mask = bitmask_to_additive(self.bitmask, logits.shape[-1], logits.device)
        if len(self.rows) == logits.shape[0]:
            return logits.add_(mask)
        return logits.index_add_(0, torch.tensor(self.rows, dtype=torch.int64, device=logits.device), mask)


_buffers = threading.local()
_byte_tables: dict[str, torch.Tensor] = {}


def _bitmask_buffer(num_rows: int, vocab_size: int) -> torch.Tensor:
    """``[num_rows, ceil(vocab_size / 32)]`` int32: a view of this thread's buffer, grown when too small."""
    words = (vocab_size + 31) // 32
    buf = getattr(_buffers, "bitmask", None)
    if buf is None or buf.shape[0] < num_rows or buf.shape[1] != words:
        buf = torch.empty(max(num_rows, 2 * (buf.shape[0] if buf is not None else 0), 8), words, dtype=torch.int32)
        _buffers.bitmask = buf
    return buf[:num_rows]


def _byte_table(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` float32: row b holds ``0.0`` where bit j of byte b is set, ``-inf`` where it is clear."""
    table = _byte_tables.get(str(device))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)
        _byte_tables[str(device)] = table
    return table


def bitmask_to_additive(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """An xgrammar bitmask ``[R, W]`` int32 (little-endian words: token t is bit ``t % 8`` of byte ``t // 8``) as
    ``[R, vocab_size]`` float32, ``0.0`` where allowed and ``-inf`` where not: adding it masks exactly the
    tokens ``xgrammar.apply_token_bitmask_inplace`` would."""
    assert sys.byteorder == "little"  # the byte view below reads the words' bits in token order
    as_bytes = bitmask.contiguous().view(torch.uint8).to(device, torch.int64)
    mask = torch.nn.functional.embedding(as_bytes, _byte_table(device))  # [R, 4W, 8]
    return mask.view(bitmask.shape[0], -1)[:, :vocab_size]


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    """``allowed_token_ids``: every other token of the row gets ``-inf``."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask  # [N, V] bool, True where a token is banned

    @classmethod
    def from_batch(cls, batch: ProcessorBatch) -> AllowedTokenIdsLogitsProcessor | None:
        rows = [i for i, p in enumerate(batch.params) if p.allowed_token_ids]
        if not rows:
            return None
        mask = torch.zeros(len(batch.params), batch.vocab_size, dtype=torch.bool)
        mask[rows] = True
        pairs = [(i, t) for i in rows for t in batch.params[i].allowed_token_ids if t < batch.vocab_size]
        if pairs:
            r, t = zip(*pairs)
            mask[list(r), list(t)] = False
        return cls(mask.to(batch.device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill_(self.mask, float("-inf"))


class _TokenMaskLogitsProcessor(LogitsProcessor):
    """Bans the token ``ids[k]`` in row ``rows[k]`` (logit ``-inf``), for every ``k``: what bad words and min_tokens
    share; ``from_batch`` says which pairs."""

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        self.rows, self.ids = rows, ids

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[self.rows, self.ids] = float("-inf")
        return logits


class BadWordsLogitsProcessor(_TokenMaskLogitsProcessor):
    """``bad_words`` (as ``bad_words_token_ids``): a word's last token gets ``-inf`` when the output ends with
    the rest of the word (a one-token word: always). vLLM's ``apply_bad_words``."""

    @classmethod
    def from_batch(cls, batch: ProcessorBatch) -> BadWordsLogitsProcessor | None:
        rows: list[int] = []
        ids: list[int] = []
        for i, p in enumerate(batch.params):
            if not p.bad_words_token_ids:
                continue
            out = batch.output_token_ids[i]
            for word in p.bad_words_token_ids:
                prefix = word[:-1]
                if len(prefix) <= len(out) and (not prefix or list(out[len(out) - len(prefix):]) == prefix):
                    rows.append(i)
                    ids.append(word[-1])
        if not rows:
            return None
        return cls(*_masked_pairs(rows, ids, batch.device))


class MinTokensLogitsProcessor(_TokenMaskLogitsProcessor):
    """``min_tokens``: while a row has fewer outputs, its ``stop_token_ids`` and EOS (unless ``ignore_eos``)
    get ``-inf``."""

    @classmethod
    def from_batch(cls, batch: ProcessorBatch) -> MinTokensLogitsProcessor | None:
        rows: list[int] = []
        ids: list[int] = []
        for i, p in enumerate(batch.params):
            if p.min_tokens and len(batch.output_token_ids[i]) < p.min_tokens:
                stops = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stops.update(batch.eos_token_ids)
                stops = [t for t in stops if t < batch.vocab_size]
                rows.extend([i] * len(stops))
                ids.extend(stops)
        if not rows:
            return None
        return cls(*_masked_pairs(rows, ids, batch.device))


class LogitBiasLogitsProcessor(LogitsProcessor):
    """``logit_bias``: adds each listed token's bias to its logit (OpenAI; +100 all but forces a token)."""

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor) -> None:
        self.rows, self.ids, self.bias = rows, ids, bias

    @classmethod
    def from_batch(cls, batch: ProcessorBatch) -> LogitBiasLogitsProcessor | None:
        rows: list[int] = []
        ids: list[int] = []
        bias: list[float] = []
        for i, p in enumerate(batch.params):
            for token, value in (p.logit_bias or {}).items():
                if token < batch.vocab_size:
                    rows.append(i)
                    ids.append(token)
                    bias.append(value)
        if not rows:
            return None
        return cls(*_masked_pairs(rows, ids, batch.device),
                   torch.tensor(bias, dtype=torch.float32, device=batch.device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_((self.rows, self.ids), self.bias, accumulate=True)


class MinPLogitsProcessor(LogitsProcessor):
    """``min_p``: keeps the tokens whose probability (after temperature) is at least ``min_p`` times the most
    likely one's, the others get ``-inf`` (vLLM's ``MinPLogitsProcessor``, HF's ``MinPLogitsWarper`` rule)."""

    argmax_invariant = True

    def __init__(self, rows: torch.Tensor, min_p: torch.Tensor, num_rows: int) -> None:
        self.rows, self.min_p, self.num_rows = rows, min_p, num_rows

    @classmethod
    def from_batch(cls, batch: ProcessorBatch) -> MinPLogitsProcessor | None:
        rows = [i for i, p in enumerate(batch.params) if p.min_p > 0.0]
        if not rows:
            return None
        min_p = [batch.params[i].min_p for i in rows]
        return cls(torch.tensor(rows, dtype=torch.int64, device=batch.device),
                   torch.tensor(min_p, dtype=torch.float32, device=batch.device).unsqueeze(1), len(batch.params))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        every_row = len(self.rows) == self.num_rows
        x = logits if every_row else logits[self.rows]
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < self.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        if every_row:
            return x
        out = logits.clone()
        out[self.rows] = x
        return out


# The order the sampler applies them in, per kind (see the module docstring).
LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    GrammarBitmaskLogitsProcessor,
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
)


def build_logits_processors(batch: ProcessorBatch, argmax_invariant: bool) -> list[LogitsProcessor]:
    """The processors of one kind that apply to ``batch`` this step, in ``LOGITS_PROCESSORS`` order."""
    built = (cls.from_batch(batch) for cls in LOGITS_PROCESSORS if cls.argmax_invariant == argmax_invariant)
    return [p for p in built if p is not None]
