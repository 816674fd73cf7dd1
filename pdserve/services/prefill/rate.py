"""A prefill pod's measured prefill rate: prompt tokens per second of engine steps, over a recent window.

Routers estimate a prompt's TTFT on the prefill tier from it (``pdserve/services/router/pd_policy.py``). A fixed
``--prefill-tokens-per-s`` was 10x off on a loaded host (pdserve/loadtest/README.md, pd-vs-colocated); the rate the
engine actually reaches follows the host's load, the model, the dtype and the threads without a setting.
"""

from __future__ import annotations

from collections import deque

_MIN_BUSY_S = 0.2  # below this much step time a ratio is mostly timer noise


class PrefillRate:
    """``add(now, prompt_tokens, busy_seconds)`` with the engine's running totals (``EngineStats``
    ``prompt_tokens_computed`` and ``busy_seconds``); ``tokens_per_s()`` is their ratio over the samples of the last
    ``window_s`` seconds, else over the pod's whole life (an idle window), else 0.0 (nothing prefilled yet)."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int, float]] = deque()

    def add(self, now: float, prompt_tokens: int, busy_seconds: float) -> None:
        self._samples.append((now, prompt_tokens, busy_seconds))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()  # keep one sample at or before the window's start

    def tokens_per_s(self) -> float:
        if not self._samples:
            return 0.0
        _, tokens0, busy0 = self._samples[0]
        _, tokens, busy = self._samples[-1]
        if busy - busy0 >= _MIN_BUSY_S and tokens > tokens0:
            return (tokens - tokens0) / (busy - busy0)
        return tokens / busy if busy >= _MIN_BUSY_S and tokens else 0.0
