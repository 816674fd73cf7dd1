"""Request arrival times from a gamma process, as vLLM ``bench serve`` draws them.

Inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate and
coefficient of variation 1/sqrt(burstiness). burstiness 1 is a Poisson process; below 1 burstier,
above 1 more regular. An infinite rate sends everything at t = 0.
"""

from __future__ import annotations

import math

import numpy as np


def gamma_intervals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """``n`` inter-arrival gaps in seconds (all 0 when ``rate`` is infinite)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Intended send offsets in seconds from the benchmark start; the first request goes at 0.

    Offsets are cumulative targets, so a late wake-up never shifts later requests (no drift).
    """
    gaps = gamma_intervals(max(n - 1, 0), rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]
