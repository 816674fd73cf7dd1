"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

Validation follows vLLM (``vllm/sampling_params.py``) with one deliberate difference: ``top_k`` is
``-1`` when disabled and ``0`` is rejected. Every error is a :class:`SamplingParamsError` (a
``ValueError``) whose ``.param`` names the offending field, so the router can fill the OpenAI error
body's ``param`` without parsing messages. Messages read ``"<param> must be <rule>, got <value>"``.

Wire rule (Redis entries, the KV hand-over's ``Commit`` frame, resumes): :meth:`SamplingParams.to_dict`, whose
values are only ``None``, bools, numbers, strings and lists of them, never a map: a map with integer keys
survives msgpack with ``strict_map_key=False`` but not the frame decoder (``strict_map_key=True``), and JSON
turns its keys into strings. So ``logit_bias`` travels as ``[[token_id, bias], ...]`` pairs, sorted by id, and
``structured_outputs`` as one ``[kind, spec]`` pair (``["json", "<schema text>"]``).
The logits processors' fields are left out while unset, so pods of the version before them (whose
``from_dict`` refuses unknown keys) keep serving the requests that do not use them during a rolling upgrade.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, fields
from typing import Any

# vLLM's _SAMPLING_EPS: a temperature below this is greedy decoding.
_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
# Stop strings are matched against the new text after every token (detokenizer.py), so a request costs
# O(#stops x stop length) per token: 20,000 stops of 60 characters took one request 118 s. OpenAI allows 4;
# these bounds leave room for real use (vLLM sets none).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
# bad_words are checked against the output after every token, like stop strings: the same bounds.
MAX_BAD_WORDS = MAX_STOP_STRINGS
MAX_BAD_WORD_CHARS = MAX_STOP_STRING_CHARS
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; ``param`` is the field name (e.g. ``"top_p"``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(param: str, rule: str, value: Any) -> SamplingParamsError:
    return SamplingParamsError(param, f"{param} must be {rule}, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop (see vLLM's ``SamplingParams``).

    ``top_k=-1``, ``top_p=1``, ``min_p=0`` disable those filters; ``temperature=0`` is greedy.
    ``max_tokens=None`` means "up to the model's context length" (the engine resolves it).
    ``logprobs=k`` returns the sampled token's logprob plus the ``k`` most likely alternatives
    (``0``: only the sampled token). ``prompt_logprobs=k``: per prompt position the prompt token's logprob
    plus the ``k`` most likely tokens there (vLLM's; the first position has none, and such a request reads no
    prefix-cache hit, so every position is computed). ``stop`` and ``stop_token_ids`` are normalised to lists.
    ``stop`` holds at most ``MAX_STOP_STRINGS`` strings of at most ``MAX_STOP_STRING_CHARS`` characters.

    Logits processors (``shared/engine/logits_processors.py``): ``logit_bias`` maps token id -> bias in
    ``[-100, 100]`` added to that logit (OpenAI; a dict, or ``[[id, bias], ...]`` pairs as on the wire);
    ``allowed_token_ids`` (non-empty) keeps only those tokens; ``bad_words`` (strings) are never generated: their
    token ids (``bad_words_token_ids``, filled by :meth:`update_from_tokenizer`, vLLM's rule) are banned when
    the output ends with all but their last token. Token ids are checked against the model by
    :meth:`check_vocabulary`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # derived from bad_words (update_from_tokenizer)
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = self._normalise_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = self._normalise_bad_words(self.bad_words)
        self.bad_words_token_ids = self._normalise_bad_words_token_ids(self.bad_words_token_ids)
        self.structured_outputs = normalise_structured_outputs(self.structured_outputs)
        self._verify()
        if self.is_greedy:
            # As vLLM: greedy decoding ignores the truncation filters.
            self.top_p = 1.0
            self.top_k = -1
            self.min_p = 0.0

    # ---- validation -------------------------------------------------------------------------

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise _fail("stop", "a string or a list of strings", stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"stop must be at most {MAX_STOP_STRINGS} strings, "
                                              f"got {len(stop)}")
        for s in stop:
            if not isinstance(s, str):
                raise _fail("stop", "a string or a list of strings", stop)
            if not s:
                raise _fail("stop", "a list of non-empty strings", stop)
            if len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingParamsError("stop", f"stop must be strings of at most {MAX_STOP_STRING_CHARS} "
                                                  f"characters, got one of {len(s)}")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise _fail("stop_token_ids", "a list of non-negative integers", ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                raise _fail("stop_token_ids", "a list of non-negative integers", ids)
        return list(ids)

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        rule = "a map (or [[id, bias], ...] pairs) of token id -> bias"
        if isinstance(bias, dict):
            pairs = list(bias.items())
        elif isinstance(bias, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in bias):
            pairs = [tuple(x) for x in bias]
        else:
            raise _fail("logit_bias", rule, bias)
        out: dict[int, float] = {}
        for token, value in pairs:
            if not _is_int(token) or token < 0:
                raise _fail("logit_bias", "keyed by non-negative integer token ids", token)
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise SamplingParamsError("logit_bias", f"logit_bias must be biases in [-{MAX_LOGIT_BIAS:g}, "
                                                        f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token}")
            out[token] = float(value)
        return out or None

    @staticmethod
    def _normalise_allowed_token_ids(ids: Any) -> list[int] | None:
        if ids is None:
            return None
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not ids:
            raise _fail("allowed_token_ids", "a non-empty list of non-negative integers", ids)
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise _fail("allowed_token_ids", "a non-empty list of non-negative integers", ids)
        return list(ids)

    @staticmethod
    def _normalise_bad_words(words: Any) -> list[str]:
        if words is None:
            return []
        if isinstance(words, (str, bytes)) or not isinstance(words, (list, tuple)):
            raise _fail("bad_words", "a list of strings", words)
        if len(words) > MAX_BAD_WORDS:
            raise SamplingParamsError("bad_words", f"bad_words must be at most {MAX_BAD_WORDS} strings, "
                                                   f"got {len(words)}")
        for w in words:
            if not isinstance(w, str) or not w.strip():
                raise _fail("bad_words", "a list of non-blank strings", words)
            if len(w) > MAX_BAD_WORD_CHARS:
                raise SamplingParamsError("bad_words", f"bad_words must be strings of at most {MAX_BAD_WORD_CHARS} "
                                                       f"characters, got one of {len(w)}")
        return list(words)

    @staticmethod
    def _normalise_bad_words_token_ids(seqs: Any) -> list[list[int]] | None:
        if seqs is None:
            return None
        rule = "a list of non-empty lists of non-negative integers"
        if not isinstance(seqs, (list, tuple)):
            raise _fail("bad_words_token_ids", rule, seqs)
        for seq in seqs:
            if not isinstance(seq, (list, tuple)) or not seq or not all(_is_int(t) and t >= 0 for t in seq):
                raise _fail("bad_words_token_ids", rule, seqs)
        return [list(seq) for seq in seqs]

    def _verify(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _fail("n", "an integer >= 1", self.n)
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise _fail("temperature", "a finite number", self.temperature)
        if self.temperature < 0:
            raise _fail("temperature", "non-negative", self.temperature)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", "in (0, 1]", self.top_p)
        self.top_k = self._verify_top_k(self.top_k)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise _fail("seed", f"an integer in [{_SEED_MIN}, {_SEED_MAX}] or null", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise _fail(name, "in [-2, 2]", value)
        if (
            not _is_number(self.repetition_penalty)
            or not math.isfinite(self.repetition_penalty)
            or self.repetition_penalty <= 0.0
        ):
            raise _fail("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _fail("max_tokens", "an integer >= 1 or null", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _fail("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"<= max_tokens={self.max_tokens}", self.min_tokens)
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise _fail("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or null", self.logprobs)
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise _fail("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}] or null", self.prompt_logprobs)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "a boolean", getattr(self, name))

    @staticmethod
    def _verify_top_k(top_k: Any) -> int:
        if isinstance(top_k, float) and top_k.is_integer():
            top_k = int(top_k)
        if not _is_int(top_k) or not (top_k == -1 or top_k >= 1):
            raise _fail("top_k", "-1 (disabled) or an integer >= 1", top_k)
        return top_k

    # ---- derived ----------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def all_stop_token_ids(self, eos_token_ids: set[int] | frozenset[int]) -> set[int]:
        """Token ids that finish the request: ``stop_token_ids`` plus EOS unless ``ignore_eos``."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return ids

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Fill ``bad_words_token_ids`` from ``bad_words`` (no-op when already filled or without bad words).

        vLLM's rule: each word is encoded without special tokens as written (leading spaces stripped) and, when
        that gives a different first token and as many tokens, also with one leading space, so the word is
        banned at the start of the text and after a space. ``tokenizer``: anything with HF's ``encode(text,
        add_special_tokens=False)``.
        """
        if self.bad_words_token_ids is not None or not self.bad_words:
            return
        out: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        self.bad_words_token_ids = out

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise ``SamplingParamsError`` naming the field when a token id is not below ``vocab_size``."""
        for name, ids in (("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for seq in self.bad_words_token_ids or () for t in seq])):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise SamplingParamsError(name, f"{name} must be token ids below the vocabulary size {vocab_size}, "
                                                f"got {bad}")

    # ---- wire form --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field, by the module's wire rule: ``logit_bias`` as sorted ``[[id, bias], ...]`` pairs, lists
        copied (JSON- and msgpack-safe, with string keys only); unset logits-processor fields left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _OMITTED_WHEN_UNSET and not value:
                continue
            if f.name == "logit_bias":
                value = [[token, bias] for token, bias in sorted(value.items())]
            elif f.name == "bad_words_token_ids" and value is not None:
                value = [list(seq) for seq in value]
            elif f.name == "structured_outputs":
                value = [self.structured_kind, value[self.structured_kind]]
            out[f.name] = list(value) if isinstance(value, list) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_dict`; missing keys take defaults, unknown keys raise."""
        known = _FIELD_NAMES
        for key in data:
            if key not in known:
                raise SamplingParamsError(str(key), f"unknown sampling parameter {key!r}")
        return cls(**data)

    @property
    def structured_kind(self) -> str | None:
        """Which ``structured_outputs`` key is set (``"json"``, ``"regex"``, ...), or ``None``."""
        return next(iter(self.structured_outputs)) if self.structured_outputs else None

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def for_child(self, index: int) -> SamplingParams:
        """Params of the ``index``-th of ``n`` parallel samples: ``n=1`` and, when seeded,
        ``seed + index`` (as vLLM v1's ``ParentRequest``), so seeded siblings differ yet repeat."""
        child = self.clone()
        child.n = 1
        if self.seed is not None:
            seed = self.seed + index
            child.seed = seed - 2**64 if seed > _SEED_MAX else seed
        return child


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
# Added after the wire's first version: left out of to_dict while unset (see the module docstring).
_OMITTED_WHEN_UNSET = frozenset({"logit_bias", "allowed_token_ids", "bad_words", "bad_words_token_ids",
                                 "structured_outputs"})

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# A schema, regex or grammar is compiled per request (cached by its text): bound what one request may send.
MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024


def normalise_structured_outputs(value: Any) -> dict[str, Any] | None:
    """The canonical ``structured_outputs`` map: one key of ``STRUCTURED_OUTPUT_KINDS``, a ``json`` schema as
    compact JSON text (key order kept: it is the order the properties are generated in). ``None`` / ``{}`` / keys
    set to null (vLLM's dataclass sends them) mean unset. Raises ``SamplingParamsError("structured_outputs")``
    for any other shape; whether the schema, regex or grammar compiles is the engine's check."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str):
        value = {value[0]: value[1]}  # the wire form
    if not isinstance(value, dict):
        raise _fail("structured_outputs", "a map with one of the keys " + ", ".join(STRUCTURED_OUTPUT_KINDS), value)
    set_keys = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = [k for k in set_keys if k not in STRUCTURED_OUTPUT_KINDS]
    if unknown:
        raise SamplingParamsError("structured_outputs", f"structured_outputs has unsupported key(s) {unknown}; "
                                  f"supported: {', '.join(STRUCTURED_OUTPUT_KINDS)}")
    if not set_keys:
        return None
    if len(set_keys) > 1:
        raise SamplingParamsError("structured_outputs", "structured_outputs must set exactly one of "
                                  f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {sorted(set_keys)}")
    (kind, spec), = set_keys.items()
    if kind == "json":
        spec = _schema_text(spec)
    elif kind == "json_object":
        if spec is not True:
            raise _fail("structured_outputs", "json_object: true", spec)
    elif kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec):
            raise _fail("structured_outputs", "choice: a non-empty list of strings", spec)
        spec = list(spec)
    elif not isinstance(spec, str) or not spec:
        raise _fail("structured_outputs", f"{kind}: a non-empty string", spec)
    size = len(spec) if isinstance(spec, str) else sum(len(c) for c in spec) if kind == "choice" else 0
    if size > MAX_STRUCTURED_OUTPUT_CHARS:
        raise SamplingParamsError("structured_outputs", f"structured_outputs {kind} must be at most "
                                  f"{MAX_STRUCTURED_OUTPUT_CHARS} characters, got {size}")
    return {kind: spec}


# JSON-schema keywords the grammar compiler (xgrammar) would silently not enforce: refused, so that an answer is
# never claimed to follow a schema it may break (vLLM falls back to another backend for these).
UNSUPPORTED_JSON_SCHEMA_KEYWORDS = frozenset({
    "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains", "dependentSchemas",
    "dependentRequired", "unevaluatedProperties", "unevaluatedItems", "propertyNames", "minProperties",
    "maxProperties", "multipleOf", "patternProperties"})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties")


def unsupported_json_schema_keyword(schema: Any, path: str = "") -> str | None:
    """The first keyword of ``UNSUPPORTED_JSON_SCHEMA_KEYWORDS`` used anywhere in ``schema``, as ``path/keyword``,
    or ``None`` (property names are names, not keywords)."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED_JSON_SCHEMA_KEYWORDS:
            return f"{path}{key}"
    children = [(f"{k}/{name}/", sub) for k in _SUBSCHEMA_MAPS if isinstance(schema.get(k), dict)
                for name, sub in schema[k].items()]
    children += [(f"{k}/{i}/", sub) for k in _SUBSCHEMA_LISTS if isinstance(schema.get(k), list)
                 for i, sub in enumerate(schema[k])]
    children += [(f"{k}/", schema[k]) for k in _SUBSCHEMAS if k in schema]
    for where, sub in children:
        found = unsupported_json_schema_keyword(sub, path + where)
        if found is not None:
            return found
    return None


def _schema_text(schema: Any) -> str:
    import json

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise SamplingParamsError("structured_outputs", f"structured_outputs json is not valid JSON: {exc}") \
                from exc
    if not isinstance(schema, (dict, bool)):
        raise _fail("structured_outputs", "json: a JSON schema (an object)", schema)
    keyword = unsupported_json_schema_keyword(schema)
    if keyword is not None:
        raise SamplingParamsError("structured_outputs", f"structured_outputs json uses {keyword!r}, a JSON-schema "
                                  "keyword the grammar cannot enforce; unsupported: "
                                  + ", ".join(sorted(UNSUPPORTED_JSON_SCHEMA_KEYWORDS)))
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
