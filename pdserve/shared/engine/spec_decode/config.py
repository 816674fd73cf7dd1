"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, checked field by field.

Accepted shapes (vLLM's names)::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "<dir or name>", "num_speculative_tokens": 3}

plus ``disable_by_batch_size`` (vLLM's: no speculation while more requests than this run) and pdserve's
``adaptive`` (default true: lower k per step when acceptance is low, see ``policy``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
_DEFAULT_LOOKUP = 5  # vLLM's default when neither prompt_lookup_min nor prompt_lookup_max is given


@dataclass(slots=True)
class SpeculativeConfig:
    """method: ``ngram`` | ``draft_model``; num_speculative_tokens: k >= 1 proposed per step;
    prompt_lookup_min/max: n-gram lengths searched (ngram); model: the draft model (draft_model);
    disable_by_batch_size: speculation off while more requests than this run (None: never);
    adaptive: shrink k per request from its acceptance rate."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @classmethod
    def from_dict(cls, data: dict | str | None) -> SpeculativeConfig | None:
        """Parse vLLM's dict (or its JSON text). ``None``/``{}`` -> ``None``. Raises ``ValueError`` naming the field."""
        if data is None or data == "" or data == {}:
            return None
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        data = dict(data)
        if "method" not in data and data.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            data["method"] = "ngram"
            data.pop("model")
        if "method" not in data:
            data["method"] = "draft_model" if data.get("model") else None
        if "num_speculative_tokens" not in data:
            raise ValueError("speculative_config.num_speculative_tokens is required (tokens proposed per step)")
        config = cls(**data)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "ngram":
            self._validate_ngram()
        elif not self.model or not isinstance(self.model, str):
            raise ValueError("speculative_config.model is required for method 'draft_model' (a model name or directory)")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {b!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")

    def _validate_ngram(self) -> None:
        if self.model is not None:
            raise ValueError("speculative_config.model is only for method 'draft_model'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if lo is None and hi is None:
            lo = hi = _DEFAULT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
