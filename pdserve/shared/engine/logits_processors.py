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
    synced to the row's output tokens (the replay rule of ``structured_output.py``), then fills its row of an
    xgrammar bitmask (one bit per token), applied in one call."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor) -> None:
        self.rows, self.bitmask = rows, bitmask  # bitmask: [N, ceil(vocab / 32)] int32, every bit set off rows

    @classmethod
    def from_batch(cls, batch: ProcessorBatch) -> GrammarBitmaskLogitsProcessor | None:
        rows = [i for i, g in enumerate(batch.grammars) if g is not None]
        if not rows:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(batch.params), batch.vocab_size)
        for i in rows:
            grammar = batch.grammars[i]
            grammar.sync(batch.output_token_ids[i])
            grammar.fill_bitmask(bitmask, i)
        return cls(rows, bitmask)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        import xgrammar as xgr

        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=self.rows)
        return logits


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
