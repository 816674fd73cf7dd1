"""Service-level objectives for sweeps: per-request attainment (DistServe) or percentile bounds (MLPerf).

- attainment: a run passes when at least ``attainment`` (default 90%) of *all* requests meet both the
  TTFT and the TPOT SLO (DistServe, OSDI'24: "goodput"; failed requests count as missed).
- percentile: a run passes when the ``percentile`` of TTFT and of TPOT are both within their SLOs
  (MLPerf Inference LLM server scenario; failed requests count as infinitely slow).

Presets are MLPerf Inference's Llama-2-70B server constraints: 2,000 ms TTFT / 200 ms TPOT, and the
interactive scenario's 450 ms / 40 ms, both at p99.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.loadtest.metrics import good_fraction, output_len, request_tpot
from pdserve.loadtest.timeline import RequestRecord


@dataclass(slots=True)
class SloSpec:
    ttft_ms: float
    tpot_ms: float
    mode: str = "attainment"
    attainment: float = 0.9
    percentile: float = 99.0
    name: str = "custom"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "mode": self.mode,
                "attainment": self.attainment if self.mode == "attainment" else None,
                "percentile": self.percentile if self.mode == "percentile" else None}


PRESETS = {
    "mlperf-server": SloSpec(2000.0, 200.0, "percentile", percentile=99.0, name="mlperf-server"),
    "mlperf-interactive": SloSpec(450.0, 40.0, "percentile", percentile=99.0, name="mlperf-interactive"),
}


def evaluate(spec: SloSpec, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """``{"slo_pass", "slo_attainment", "slo_p_ttft_ms", "slo_p_tpot_ms"}`` for one run."""
    slos = {"ttft": spec.ttft_ms, "tpot": spec.tpot_ms}
    attained = good_fraction(records, slos)
    ttfts = [r.ttft * 1e3 if r.success else math.inf for r in records]
    tpots = []
    for r in records:
        if not r.success:
            tpots.append(math.inf)
        elif (t := request_tpot(r, output_len(r))) is not None:
            tpots.append(t * 1e3)
    p_ttft = float(np.percentile(ttfts, spec.percentile, method="higher")) if ttfts else math.inf
    p_tpot = float(np.percentile(tpots, spec.percentile, method="higher")) if tpots else 0.0
    if spec.mode == "percentile":
        ok = p_ttft <= spec.ttft_ms and p_tpot <= spec.tpot_ms
    else:
        ok = attained >= spec.attainment
    return {"slo_pass": bool(ok), "slo_attainment": attained, "slo_p_ttft_ms": p_ttft, "slo_p_tpot_ms": p_tpot}


def slo_capacity(points: Sequence[dict[str, Any]]) -> float | None:
    """Highest offered rate that passes with every lower tested rate passing too (None if the lowest fails)."""
    best = None
    for p in sorted(points, key=lambda p: p["offered_rate"]):
        if not p["slo_pass"]:
            break
        best = p["offered_rate"]
    return best
