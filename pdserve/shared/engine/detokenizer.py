"""Incremental detokenization, stop strings and stop tokens for one request.

Detokenization uses the prefix/read-offset method of HF TGI and vLLM (``detokenize_incrementally``):
decode a short window of ids ending at the newest token, and emit what it adds beyond the window's
already-emitted part, unless that ends in U+FFFD (an incomplete UTF-8 sequence split across byte-level
tokens, which the next token may complete). Each step decodes only the tokens since the last
emission, so the cost is O(new text), not O(output). The window is primed with the prompt's last
tokens so SentencePiece-style leading spaces decode as they do in context; a prompt that ends inside
a UTF-8 sequence is not used as context, so the output decodes exactly like
``tokenizer.decode(output_ids)``. (``tokenizers.decoders.DecodeStream`` implements the same method in
Rust but cannot flush an incomplete tail at the end of a request, which ``decode`` of the full output
does as U+FFFD; hence our own loop over ``Tokenizer.decode``, a few microseconds per call.)

Stop strings follow vLLM: matched across token boundaries in the new text only; the output is cut
before the match (or after it with ``include_stop_str_in_output``). Text that might still become a
match (the longest suffix that is a proper prefix of a stop string) is held back from the caller
until it cannot match or the request finishes, so nothing returned is ever retracted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from pdserve.shared.protocol.sampling_params import SamplingParams

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens used as decoding context.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def check_stop_token(
    token_id: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    num_output_tokens: int,
) -> str | None:
    """Finish reason after sampling ``token_id`` (``num_output_tokens`` counts it), else None.

    ``"stop"``: EOS (unless ``ignore_eos``) or one of ``stop_token_ids``, but only once more than
    ``min_tokens`` tokens exist (the sampler masks them before that). ``"length"``: ``max_tokens``
    reached. The stop token stays in the output token ids; pass ``stop_terminated=True`` to
    :meth:`IncrementalDetokenizer.update` so its text is not added (vLLM's rule).
    """
    if num_output_tokens > params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return "length"
    return None


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, step by step.

    ``tokenizer``: a ``transformers`` tokenizer (its Rust ``backend_tokenizer`` is used when present)
    or a ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._decode_fn, self._byte_level = _decoder(tokenizer, params)
        self._stop = params.stop or []
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_output_tokens = 0

        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT):
            context, context_text = [], ""
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text

        self._text = ""
        self._returned = 0  # chars handed out by get_next_output_text(delta=True)
        self._finished = False
        self.stop_string: str | None = None

    # ---- state ------------------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """Full text so far; while unfinished, without the tail a stop string may still cut."""
        return self._text[: len(self._text) - self._held_back()]

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    # ---- steps ------------------------------------------------------------------------------

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Add sampled tokens; returns the stop string that matched (the request is then finished).

        ``stop_terminated``: the last id is an EOS / stop token that ends the request (see
        :func:`check_stop_token`); it is counted but not detokenized unless
        ``include_stop_str_in_output``. Tokens after a matched stop string are ignored.
        """
        if self._finished:
            return self.stop_string
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self._num_output_tokens += 1
            if i == last and stop_terminated and not self._include_stop:
                break
            before = len(self._text)
            new_text = self._decode_next(token_id)
            if not new_text:
                continue
            self._text += new_text
            if self._stop and self._num_output_tokens > self._min_tokens:
                matched = self._find_stop(before)
                if matched is not None:
                    self.stop_string = matched
                    self._finished = True
                    return matched
        return None

    def resume(self, token_ids: Sequence[int], text_len: int) -> None:
        """Start from output generated elsewhere (a migrated request): ``token_ids`` are decoded as output
        without a stop-string search (a match there would have ended the request), and the first
        ``text_len`` characters count as returned. A stop string that begins in that text and ends in
        new text is still found (``_find_stop`` looks back), and the unreturned tail — text the other
        engine held back — is returned with the next delta. Call before any ``update``.
        """
        for token_id in token_ids:
            self._num_output_tokens += 1
            self._text += self._decode_next(token_id)
        self._returned = max(0, min(text_len, len(self._text)))

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the caller: the not-yet-returned part (``delta``) or all of it so far.

        ``finished=True`` ends the request: an incomplete UTF-8 tail is flushed (as U+FFFD, like
        ``decode``) and held-back text is released. The concatenation of all deltas is always a
        prefix of the final text.
        """
        if finished and not self._finished:
            self._finish()
        end = len(self._text) - self._held_back()
        if not delta:
            return self._text[:end]
        if end <= self._returned:
            return ""
        out = self._text[self._returned:end]
        self._returned = end
        return out

    # ---- internals --------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids)

    def _decode_next(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        text = self._decode(ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        new_text = text[len(self._prefix_text):]
        if self._prefix_offset > 64:
            # Keep the id window short; offsets move with it.
            del ids[: self._read_offset]
            self._prefix_offset, self._read_offset = 0, len(ids)
        else:
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        # Byte-level text splits cleanly at a complete character: the new window decodes to new_text.
        self._prefix_text = new_text if self._byte_level else self._decode(ids[self._prefix_offset:self._read_offset])
        return new_text

    def _finish(self) -> None:
        self._finished = True
        if self.stop_string is None and len(self._ids) > self._read_offset:
            text = self._decode(self._ids[self._prefix_offset:])
            self._text += text[len(self._prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = ""

    def _find_stop(self, before: int) -> str | None:
        """Earliest stop string ending in the text added after offset ``before``; cuts the text."""
        text = self._text
        best_at, best = -1, None
        for stop in self._stop:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at != -1 and (best is None or at < best_at):
                best_at, best = at, stop
        if best is None:
            return None
        self._text = text[: best_at + len(best)] if self._include_stop else text[:best_at]
        return best

    def _held_back(self) -> int:
        if self._finished or self._include_stop or not self._stop:
            return 0
        text = self._text
        held = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held


def _decoder(tokenizer: Any, params: SamplingParams) -> tuple[Callable[[list[int]], str], bool]:
    """``decode(ids)`` for this request, and whether the decoder is byte-level (GPT-2 style)."""
    skip = params.skip_special_tokens
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
        backend = tokenizer
    if backend is not None:
        decode = backend.decode
        byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        return (lambda ids: decode(ids, skip_special_tokens=skip)), byte_level
    # Python ("slow") tokenizers.
    spaces = params.spaces_between_special_tokens
    return (lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces,
        clean_up_tokenization_spaces=False,
    )), False
