"""Turn the tiers' Prometheus text (GET /metrics of each pod) into the planner's signals.

Metric names are the TEAM contract's (vLLM's with a ``pdserve:`` prefix). Counters and histograms are
cumulative per pod, so rates and interval means come from the difference between two scrapes of the same
pod; a pod whose counter went down restarted, and its new value is its whole delta (Prometheus ``rate()``
treats resets the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

PROMPT_TOKENS_TOTAL = "pdserve:prompt_tokens_computed_total"  # prompt tokens a prefill pod computed
KV_CACHE_USAGE = "pdserve:kv_cache_usage_perc"
PREFILL_QUEUE_TOKENS = "pdserve:prefill_queue_tokens"
TTFT = "pdserve:time_to_first_token_seconds"
TPOT = "pdserve:time_per_output_token_seconds"


class MetricsParseError(ValueError):
    """A /metrics body that is not Prometheus text format."""


def parse_samples(text: str) -> dict[str, float]:
    """Sum of every sample value by sample name (labels summed over), from Prometheus text ``text``.

    Sample names keep their suffixes: a counter ``pdserve:prompt_tokens`` appears as
    ``pdserve:prompt_tokens_total``, a histogram as ``..._sum`` / ``..._count`` / ``..._bucket``.
    """
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    continue
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    except ValueError as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from exc
    return out


@dataclass(slots=True)
class CounterDeltas:
    """Per-pod deltas of cumulative series between successive scrapes."""

    _last: dict[tuple[str, str], float] = field(default_factory=dict)

    def delta(self, pods: Mapping[str, Mapping[str, float]], name: str) -> tuple[float, int]:
        """Sum of ``name``'s increase over the pods seen both now and last time, and how many such pods.

        ``pods`` maps pod name -> its samples (:func:`parse_samples`). Pods that vanished are forgotten.
        """
        total, seen = 0.0, 0
        current: dict[tuple[str, str], float] = {}
        for pod, samples in pods.items():
            if name not in samples:
                continue
            value = samples[name]
            current[(pod, name)] = value
            before = self._last.get((pod, name))
            if before is not None:
                total += value - before if value >= before else value
                seen += 1
        self._last = {k: v for k, v in self._last.items() if k[1] != name} | current
        return total, seen


def mean_over_interval(deltas: CounterDeltas, pods: Mapping[str, Mapping[str, float]], histogram: str) -> float | None:
    """Mean observation of ``histogram`` over the interval since the last call (None: no observations)."""
    total, _ = deltas.delta(pods, histogram + "_sum")
    count, _ = deltas.delta(pods, histogram + "_count")
    return total / count if count > 0 else None


def gauge_mean(pods: Iterable[Mapping[str, float]], name: str) -> float | None:
    values = [samples[name] for samples in pods if name in samples]
    return sum(values) / len(values) if values else None


def gauge_max(pods: Iterable[Mapping[str, float]], name: str) -> float | None:
    values = [samples[name] for samples in pods if name in samples]
    return max(values) if values else None
