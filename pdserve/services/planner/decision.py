"""The planner's policy: metric snapshot in, replica count out. Pure functions, no I/O, time passed in.

Two steps per tier and round:

1. A raw **recommendation** from the tier's signal:
   - prefill (:func:`recommend_prefill`): enough replicas to serve the prompt tokens arriving and to drain the
     queued ones within the TTFT objective,
     ``ceil((arrival_tokens_per_s + backlog_tokens / ttft_slo_s) / throughput_per_replica)``;
     one more than now when the measured TTFT is over the objective while a backlog exists.
   - decode (:func:`recommend_decode`): the HPA rule on a utilization, ``ceil(current * usage / target)`` with
     KV-cache usage against its target, or TPOT against its objective, whichever is further over; left alone
     within ``tolerance`` of the target.
2. :func:`decide` damps it the way the Kubernetes HPA does (pkg/controller/podautoscaler, "stabilization
   window"): scale up only to the *lowest* recommendation of the up-window, down only to the *highest* of the
   down-window; then clamps to [min, max]; holds a scale-up while pods of the tier are still Pending (more
   replicas would only pile up unschedulable pods); respects cooldowns; and backs off when the observed
   replica count differs from the one it last applied (someone scaled by hand: it logs and holds for
   ``manual_backoff_s``, then adopts the count it finds).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

logger = logging.getLogger(__name__)

SCALE_UP = "scale_up"
SCALE_DOWN = "scale_down"
HOLD = "hold"

# Counts such as 4.000000001 (float noise) must not round up to 5.
_EPS = 1e-9


@dataclass(slots=True, frozen=True)
class TierPolicy:
    """Bounds and damping of one tier. Times in seconds."""

    min_replicas: int
    max_replicas: int
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    # No second scale-up sooner than this after the last one (new pods need time to load the model).
    scale_up_cooldown_s: float = 60.0
    # No scale-down sooner than this after any change.
    scale_down_cooldown_s: float = 120.0
    manual_backoff_s: float = 900.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")


@dataclass(slots=True, frozen=True)
class TierObservation:
    """What the Kubernetes API says about a tier now."""

    spec_replicas: int  # the Deployment's scale spec.replicas
    pending_pods: int = 0  # pods of the tier in phase Pending (unscheduled or pulling)


@dataclass(slots=True, frozen=True)
class TierState:
    """What the planner remembers about a tier between rounds."""

    last_applied: int | None = None
    last_scale_up_at: float | None = None
    last_change_at: float | None = None
    backoff_until: float | None = None
    # (time, recommendation) of recent rounds, oldest first, for the stabilization windows.
    history: tuple[tuple[float, int], ...] = ()


@dataclass(slots=True, frozen=True)
class Decision:
    """One tier's outcome of a round."""

    tier: str
    current: int
    recommended: int
    desired: int
    action: str  # SCALE_UP | SCALE_DOWN | HOLD
    reason: str

    @property
    def changes(self) -> bool:
        return self.desired != self.current


@dataclass(slots=True, frozen=True)
class PrefillSignals:
    """Prefill tier load, tokens and seconds.

    ``arrival_tokens_per_s``: prompt tokens entering the tier per second (the tier's measured processing rate
    plus the backlog's growth). ``throughput_per_replica``: prompt tokens per second one replica sustains
    (measured while the queue was non-empty, else a prior). ``ttft_s``: mean TTFT over the last interval, or
    None when no request finished.
    """

    backlog_tokens: float
    arrival_tokens_per_s: float
    throughput_per_replica: float
    ttft_s: float | None = None


@dataclass(slots=True, frozen=True)
class DecodeSignals:
    """Decode tier load: mean KV-cache usage of its pods (0..1) and mean TPOT (s); None = not measured."""

    kv_cache_usage: float | None
    tpot_s: float | None = None


@dataclass(slots=True, frozen=True)
class Recommendation:
    replicas: int
    reason: str


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def recommend_prefill(signals: PrefillSignals, current: int, ttft_slo_s: float) -> Recommendation:
    """Replicas the prefill tier needs to meet ``ttft_slo_s`` (seconds) under ``signals``."""
    if signals.throughput_per_replica <= 0:
        raise ValueError("throughput_per_replica must be positive")
    if ttft_slo_s <= 0:
        raise ValueError("ttft_slo_s must be positive")
    demand = max(0.0, signals.arrival_tokens_per_s) + max(0.0, signals.backlog_tokens) / ttft_slo_s
    replicas = _ceil(demand / signals.throughput_per_replica)
    reason = (f"backlog {signals.backlog_tokens:.0f} tok, arrival {signals.arrival_tokens_per_s:.0f} tok/s, "
              f"{signals.throughput_per_replica:.0f} tok/s/replica, TTFT SLO {ttft_slo_s:g}s")
    if signals.ttft_s is not None and signals.ttft_s > ttft_slo_s and signals.backlog_tokens > 0 and replicas <= current:
        replicas = current + 1
        reason = f"TTFT {signals.ttft_s:.3g}s over SLO {ttft_slo_s:g}s with a backlog"
    return Recommendation(replicas, reason)


def recommend_decode(
    signals: DecodeSignals, current: int, target_kv_usage: float, tpot_slo_s: float, tolerance: float = 0.1
) -> Recommendation:
    """Replicas the decode tier needs for KV-cache usage ``target_kv_usage`` (0..1) and TPOT ``tpot_slo_s``."""
    if not 0 < target_kv_usage <= 1:
        raise ValueError("target_kv_usage must be in (0, 1]")
    ratios: list[tuple[float, str]] = []
    if signals.kv_cache_usage is not None:
        ratios.append((signals.kv_cache_usage / target_kv_usage,
                       f"KV usage {signals.kv_cache_usage:.2f} vs target {target_kv_usage:.2f}"))
    if signals.tpot_s is not None and tpot_slo_s > 0:
        ratios.append((signals.tpot_s / tpot_slo_s, f"TPOT {signals.tpot_s:.3g}s vs SLO {tpot_slo_s:g}s"))
    if not ratios:
        return Recommendation(current, "no decode metrics")
    ratio, reason = max(ratios)
    if current == 0:
        return Recommendation(1 if ratio > 0 else 0, reason)
    if abs(ratio - 1.0) <= tolerance:
        return Recommendation(current, reason + " (within tolerance)")
    return Recommendation(_ceil(current * ratio), reason)


def decide(
    tier: str, policy: TierPolicy, state: TierState, obs: TierObservation, rec: Recommendation, now: float
) -> tuple[Decision, TierState]:
    """Damp, bound and gate ``rec`` for ``tier``; returns the decision and the state to keep.

    The returned state assumes the decision is applied (``last_applied = desired``); a caller that does not
    apply it (dry run, API error) records what it observed instead (:func:`not_applied`).
    """
    current = obs.spec_replicas

    def hold(reason: str, new_state: TierState) -> tuple[Decision, TierState]:
        return Decision(tier, current, rec.replicas, current, HOLD, reason), new_state

    # Someone else sets the count: back off, then adopt theirs.
    if state.backoff_until is not None:
        if now < state.backoff_until:
            return hold(f"backing off after a manual change ({state.backoff_until - now:.0f}s left)",
                        replace(state, last_applied=current))
        state = replace(state, backoff_until=None, last_applied=current, history=())
    if state.last_applied is not None and current != state.last_applied:
        logger.warning("%s: replicas changed outside the planner (%d -> %d); holding for %.0fs",
                       tier, state.last_applied, current, policy.manual_backoff_s)
        return hold(f"replicas set to {current} by hand (planner had set {state.last_applied})",
                    replace(state, last_applied=current, backoff_until=now + policy.manual_backoff_s, history=()))

    keep = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    history = tuple((t, r) for t, r in state.history if now - t <= keep) + ((now, rec.replicas),)
    state = replace(state, history=history, last_applied=current)

    up_limit = min(r for t, r in history if now - t <= policy.scale_up_stabilization_s)
    down_limit = max(r for t, r in history if now - t <= policy.scale_down_stabilization_s)
    desired = current
    if desired < up_limit:
        desired = up_limit
    if desired > down_limit:
        desired = down_limit
    reason = rec.reason
    if desired == current and rec.replicas != current:
        reason += "; held by the stabilization window"
    bounded = min(max(desired, policy.min_replicas), policy.max_replicas)
    if bounded != desired:
        reason += f"; bounded to [{policy.min_replicas}, {policy.max_replicas}]"
        desired = bounded

    if desired > current:
        if obs.pending_pods > 0:
            return hold(f"{obs.pending_pods} pod(s) Pending; not adding more ({rec.reason})", state)
        if state.last_scale_up_at is not None and now - state.last_scale_up_at < policy.scale_up_cooldown_s:
            return hold(f"scale-up cooldown ({rec.reason})", state)
        return (Decision(tier, current, rec.replicas, desired, SCALE_UP, reason),
                replace(state, last_applied=desired, last_scale_up_at=now, last_change_at=now))
    if desired < current:
        if state.last_change_at is not None and now - state.last_change_at < policy.scale_down_cooldown_s:
            return hold(f"scale-down cooldown ({rec.reason})", state)
        return (Decision(tier, current, rec.replicas, desired, SCALE_DOWN, reason),
                replace(state, last_applied=desired, last_change_at=now))
    return hold(reason, state)


def not_applied(state: TierState, observed: int) -> TierState:
    """The state to keep when a decision was not applied: what was observed is what the planner "set"."""
    return replace(state, last_applied=observed)


@dataclass(slots=True)
class ThroughputEstimator:
    """Prompt tokens per second one prefill replica sustains: an exponential moving average of measurements
    taken while the queue was non-empty (an idle replica's rate says nothing about its capacity), starting
    from ``prior``."""

    prior: float
    alpha: float = 0.3
    estimate: float = field(init=False)
    measured: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.prior <= 0:
            raise ValueError("prior must be positive")
        self.estimate = self.prior

    def update(self, tokens_per_s_per_replica: float, saturated: bool) -> float:
        if saturated and tokens_per_s_per_replica > 0:
            if not self.measured:
                self.estimate, self.measured = tokens_per_s_per_replica, True
            else:
                self.estimate += self.alpha * (tokens_per_s_per_replica - self.estimate)
        return self.estimate
