"""Structured outputs (guided decoding): each request's grammar, compiled off the engine step, and its matcher.

The library is xgrammar (Dong et al., "XGrammar", arXiv:2411.15100), as vLLM's default backend. Measured on this
host against llguidance with SmolLM2's tokenizer (docs/engine.md "Structured outputs"): a token mask costs
~0.1 ms per step at batch 32 (llguidance ~1-1.6 ms), a compile ~1-6 ms cold and ~0.03 ms cached.

Rules:

* Checked at admission: ``StructuredOutputManager.grammar_for`` builds the xgrammar ``Grammar`` (the spec's parse,
  where an unsupported schema, regex or EBNF fails) on the caller's thread and raises ``RequestRejected`` naming
  ``structured_outputs``. The tokenizer-dependent compile runs on one background thread, cached per spec text
  (a manager belongs to one engine, so to one tokenizer): the cache is per (spec, tokenizer).
* A request whose grammar is compiling waits outside the scheduler (``pending``) and joins the waiting queue
  once it is compiled, so it never holds a batch slot or stalls a step. A hand-over committed on a decode pod
  that has not compiled its grammar yet waits the same way, holding its blocks, and rejoins the running batch.
* Replay: a matcher's state is a function of the request's output tokens. Before each mask it is synced to them
  (``RequestGrammar.sync``): tokens past its position are accepted, tokens it has but the output does not are
  rolled back (xgrammar's ``GrammarMatcher.rollback``). A decode pod, a request migrated with the output its
  client has, and a request recomputed after preemption all rebuild the state this way; nothing about the
  matcher crosses a wire.
* Speculative decoding: a request's verify rows are ``output + drafts[:j]``, j = 0..k; syncing to each in turn
  accepts one draft more, so row j's mask is the grammar's after the first j drafts (a draft the grammar
  refuses gets ``-inf`` in its row, so it is rejected and the rows after it are never reached). Appending the
  accepted tokens then syncs to the real output: the matcher rolls back to the accepted prefix and accepts the
  recovered or bonus token (vLLM's and SGLang's rule for grammar plus speculation).
* When the matcher terminates (it accepted a stop token, or the grammar cannot continue), the request finishes
  with ``"stop"``.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pdserve.shared.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# xgrammar's messages open with "[time] /path/file.cc:line: ", which tells a client nothing
_LOCATION_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
# compiled grammars kept per engine (a compiled JSON schema is tens of KiB)
_CACHE_SIZE = 256
# how far back from the end a sync looks for a divergence: more than any verify step's drafts
_DIVERGENCE_WINDOW = 64


class RequestGrammar:
    """One sequence's grammar: the compiled grammar (a ``Future``) and its matcher, synced to the output."""

    __slots__ = ("_future", "_stop_token_ids", "matcher", "tokens", "failed")

    def __init__(self, future: Future, stop_token_ids: Sequence[int]) -> None:
        self._future = future
        self._stop_token_ids = list(stop_token_ids)
        self.matcher = None
        self.tokens: list[int] = []  # what the matcher has accepted
        self.failed = False  # compile failed, or the output broke the grammar: only a stop token is allowed

    @property
    def is_ready(self) -> bool:
        return self._future.done()

    def _matcher(self):
        if self.matcher is None and not self.failed:
            import xgrammar as xgr

            try:
                self.matcher = xgr.GrammarMatcher(self._future.result(), override_stop_tokens=self._stop_token_ids)
            except Exception:  # noqa: BLE001 - the spec was checked at admission; a library bug must not kill the step
                logger.exception("compiling a grammar failed after its check passed; the request stops")
                self.failed = True
        return self.matcher

    def sync(self, output_token_ids: Sequence[int], *, strict: bool = True) -> bool:
        """Make the matcher have accepted exactly ``output_token_ids`` (the replay rule): a common prefix is kept,
        tokens past it are rolled back (a verify row's rejected drafts), the rest accepted. Returns False when a
        token is refused, the matcher then at the longest accepted prefix: ``strict`` (the request's real
        output) also marks the grammar failed (stop tokens only from now on); not strict (a speculative verify
        row whose drafts break the grammar: the row can never be reached) leaves it usable."""
        matcher = self._matcher()
        if matcher is None or self.failed:
            return True  # fill_bitmask allows stop tokens only
        tokens = self.tokens
        common = self._common_prefix(output_token_ids)
        if common < len(tokens):
            try:
                matcher.rollback(len(tokens) - common)
            except Exception:  # noqa: BLE001 - past what the matcher can roll back: replay from the start
                matcher.reset()
                common = 0
            del tokens[common:]
        for token in output_token_ids[common:]:
            if matcher.is_terminated():
                break  # tokens after a stop token: the request has ended there
            if not matcher.accept_token(token):
                if strict:
                    logger.warning("output token %d breaks the request's grammar; only a stop token is allowed now",
                                   token)
                    self.failed = True
                return False
            tokens.append(token)
        return True

    def _common_prefix(self, output_token_ids: Sequence[int]) -> int:
        """Length of the common prefix of ``self.tokens`` and ``output_token_ids``. Outputs only ever differ from
        what the matcher accepted in their last few tokens (a verify step's drafts), so only a window at the end
        is compared: O(window), not O(output), per row and step."""
        tokens = self.tokens
        common = min(len(tokens), len(output_token_ids))
        lo = max(0, common - _DIVERGENCE_WINDOW)
        head = output_token_ids[lo:common]
        if tokens[lo:common] == (head if isinstance(head, list) else list(head)):
            return common
        return next(i for i in range(lo, common) if tokens[i] != output_token_ids[i])

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int, reachable: bool = True) -> None:
        """Row ``row`` of an xgrammar bitmask (``[rows, ceil(vocab / 32)]`` int32, bit ``t % 32`` of word ``t // 32``
        set where token ``t`` is allowed): the tokens the grammar allows next. A failed grammar, or a row that is
        not ``reachable`` (``sync`` refused its drafts) or past a stop token (a verify row after a drafted EOS,
        never sampled from): the stop tokens."""
        matcher = self._matcher()
        if matcher is None or self.failed or not reachable or matcher.is_terminated():
            bitmask[row] = 0
            for token in self._stop_token_ids:
                bit = 1 << (token % 32)
                bitmask[row, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 wraps at bit 31
            return
        matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Compiles and caches one engine's grammars and holds the requests waiting for them.

    ``tokenizer``: the engine's HF tokenizer; ``vocab_size``: the model's logits width (may exceed the
    tokenizer's); ``stop_token_ids``: the model's EOS ids, which end every grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.pending: list = []  # Requests whose grammar is compiling, in arrival order

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def grammar_for(self, params: SamplingParams) -> RequestGrammar | None:
        """A new sequence's grammar (``None`` without ``structured_outputs``); starts its compile unless cached.
        Raises ``RequestRejected`` (param ``structured_outputs``) when the spec does not parse or is unsupported."""
        kind = params.structured_kind
        if kind is None:
            return None
        spec = params.structured_outputs[kind]
        key = (kind, json.dumps(spec) if kind == "choice" else str(spec))
        future = self._cache.get(key)
        if future is None:
            grammar = build_grammar(kind, spec)
            future = self._pool.submit(lambda: self._get_compiler().compile_grammar(grammar))
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return RequestGrammar(future, self.stop_token_ids)

    def take_ready(self) -> list:
        """The pending requests whose grammar is compiled, removed from ``pending``, in arrival order."""
        if not self.pending:
            return []
        ready = [r for r in self.pending if r.grammar.is_ready]
        if ready:
            self.pending = [r for r in self.pending if not r.grammar.is_ready]
        return ready

    def wait_any(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a pending grammar (the engine has nothing else to run)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if self.pending:
            wait([r.grammar._future for r in self.pending], timeout, return_when=FIRST_COMPLETED)

    def discard(self, requests: Sequence) -> set[str]:
        """Drop ``requests`` from ``pending``; returns the ids that were there."""
        ids = {r.request_id for r in requests}
        dropped = {r.request_id for r in self.pending if r.request_id in ids}
        if dropped:
            self.pending = [r for r in self.pending if r.request_id not in dropped]
        return dropped


def build_grammar(kind: str, spec: Any):
    """The xgrammar ``Grammar`` of one ``structured_outputs`` entry. JSON is compact (no free whitespace: a small
    model left free to emit whitespace can spend its whole budget on it). Raises ``RequestRejected``."""
    import xgrammar as xgr

    from pdserve.shared.engine.input_processor import RequestRejected

    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == "json_object":  # OpenAI's: a JSON object (xgrammar's builtin JSON grammar allows any value)
            return xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/TypeError by kind
        text = str(exc).strip()
        message = _LOCATION_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__
        raise RequestRejected(f"structured_outputs {kind} is invalid or unsupported: {message}",
                              "structured_outputs") from exc
