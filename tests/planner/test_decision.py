"""The planner's decision function on metric traces, against hand-computed replica counts (the trace files
say how each number follows from the formula and the HPA stabilization rule)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.services.planner.decision import (
    HOLD,
    SCALE_DOWN,
    SCALE_UP,
    DecodeSignals,
    PrefillSignals,
    Recommendation,
    ThroughputEstimator,
    TierObservation,
    TierPolicy,
    TierState,
    decide,
    recommend_decode,
    recommend_prefill,
)

TRACES = Path(__file__).parent / "traces"


def load(name: str) -> dict:
    return json.loads((TRACES / name).read_text())


def replay_prefill(trace: dict, pending: dict[int, int] | None = None, manual: dict[int, int] | None = None):
    """Run the trace through recommend_prefill + decide, applying every decision (as the planner does)."""
    policy = TierPolicy(**trace["policy"])
    state, replicas, out = TierState(), trace["start_replicas"], []
    for step in trace["steps"]:
        t = step["t"]
        if manual and t in manual:
            replicas = manual[t]
        signals = PrefillSignals(step["backlog_tokens"], step["arrival_tokens_per_s"], step["throughput_per_replica"],
                                 step.get("ttft_s"))
        rec = recommend_prefill(signals, replicas, trace["ttft_slo_s"])
        d, state = decide("prefill", policy, state, TierObservation(replicas, (pending or {}).get(t, 0)), rec, t)
        replicas = d.desired
        out.append(d)
    return out


def replay_decode(trace: dict):
    policy = TierPolicy(**trace["policy"])
    state, replicas, out = TierState(), trace["start_replicas"], []
    for step in trace["steps"]:
        rec = recommend_decode(DecodeSignals(step["kv_cache_usage"], step.get("tpot_s")), replicas,
                               trace["target_kv_usage"], trace["tpot_slo_s"], trace["tolerance"])
        d, state = decide("decode", policy, state, TierObservation(replicas), rec, step["t"])
        replicas = d.desired
        out.append(d)
    return out


def test_prefill_scales_up_under_a_growing_backlog_and_down_only_after_the_window():
    trace = load("prefill_burst.json")
    decisions = replay_prefill(trace)
    assert [d.desired for d in decisions] == trace["expected_replicas"]
    assert [d.recommended for d in decisions] == [1, 3, 6, 8, 11, 3, 0, 0, 0, 0, 0, 0]
    assert decisions[4].desired == 8 and "bounded to [1, 8]" in decisions[4].reason
    assert [d.action for d in decisions][9:] == [HOLD, SCALE_DOWN, SCALE_DOWN]


def test_decode_scales_up_only_when_kv_usage_stays_above_target():
    trace = load("decode_kv_pressure.json")
    decisions = replay_decode(trace)
    assert [d.desired for d in decisions] == trace["expected_replicas"]
    assert decisions[1].recommended == 3 and decisions[1].action == HOLD, "one spike does not scale"
    assert decisions[7].action == SCALE_UP


def test_without_an_up_window_the_spike_scales_at_once():
    trace = load("decode_kv_pressure.json")
    trace["policy"]["scale_up_stabilization_s"] = 0
    assert replay_decode(trace)[1].desired == 3


def test_no_scale_up_while_pods_are_pending():
    trace = load("prefill_burst.json")
    decisions = replay_prefill(trace, pending={15: 1, 30: 2})
    assert [d.desired for d in decisions[:4]] == [1, 1, 1, 8]
    assert decisions[1].action == HOLD and "Pending" in decisions[1].reason
    # Pending pods do not block a scale-down.
    decisions = replay_prefill(trace, pending={375: 3})
    assert decisions[10].action == SCALE_DOWN


def test_a_hand_set_replica_count_is_respected_for_the_backoff_then_adopted():
    trace = load("prefill_burst.json")
    trace["policy"]["manual_backoff_s"] = 100
    # The planner set 8 at t=45; someone scales to 2 at t=75.
    decisions = replay_prefill(trace, manual={75: 2})
    d75, d90, d180 = decisions[5], decisions[6], decisions[7]
    assert (d75.action, d75.current, d75.desired) == (HOLD, 2, 2)
    assert "by hand" in d75.reason and "planner had set 8" in d75.reason
    assert (d90.action, d90.desired) == (HOLD, 2) and "backing off" in d90.reason
    # After the back-off (t=175) the planner adopts 2 and decides from there; with no load that is min (1),
    # allowed because the hand-set history was cleared.
    assert d180.current == 2 and d180.desired == 1


def test_cooldown_spaces_out_scale_ups():
    trace = load("prefill_burst.json")
    trace["policy"]["scale_up_cooldown_s"] = 30
    decisions = replay_prefill(trace)
    assert [d.desired for d in decisions[:5]] == [1, 3, 3, 8, 8]
    assert "cooldown" in decisions[2].reason


def test_never_beyond_min_or_max():
    policy = TierPolicy(min_replicas=2, max_replicas=5, scale_down_stabilization_s=0, scale_down_cooldown_s=0,
                        scale_up_cooldown_s=0)
    d, _ = decide("prefill", policy, TierState(), TierObservation(3), Recommendation(50, "x"), 0)
    assert d.desired == 5
    d, _ = decide("prefill", policy, TierState(), TierObservation(3), Recommendation(0, "x"), 0)
    assert d.desired == 2
    # A tier found below its minimum is brought up to it.
    d, _ = decide("prefill", policy, TierState(), TierObservation(0), Recommendation(0, "x"), 0)
    assert (d.action, d.desired) == (SCALE_UP, 2)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.booleans(), st.integers(0, 12)), min_size=1, max_size=40),
    st.integers(0, 4), st.integers(0, 6), st.sampled_from([0, 30, 120]), st.sampled_from([0, 60, 300]),
)
def test_invariants_on_arbitrary_traces(steps, lo, span, up_window, down_window):
    """Whatever the signals: bounds hold, holds hold, Pending blocks growth, down never undercuts the window."""
    policy = TierPolicy(min_replicas=lo, max_replicas=lo + span, scale_up_stabilization_s=up_window,
                        scale_down_stabilization_s=down_window, scale_up_cooldown_s=15, scale_down_cooldown_s=15,
                        manual_backoff_s=60)
    state, replicas, recs = TierState(), lo, []
    for i, (rec, pending, hand, hand_to) in enumerate(steps):
        t = 15.0 * i
        if hand and i % 7 == 3:
            replicas = hand_to
        d, state = decide("t", policy, state, TierObservation(replicas, pending), Recommendation(rec, "r"), t)
        recs.append((t, rec))
        if d.action == HOLD:
            assert d.desired == d.current == replicas
        else:
            assert policy.min_replicas <= d.desired <= policy.max_replicas
            assert (d.action == SCALE_UP) == (d.desired > replicas)
        if pending:
            assert d.action != SCALE_UP
        if d.action == SCALE_DOWN:
            # Down to no less than the highest recommendation of the window (unless the maximum is lower).
            assert d.desired >= min(max(r for tt, r in recs if t - tt <= down_window), policy.max_replicas)
        if "by hand" in d.reason or "backing off" in d.reason:
            recs.clear()  # a manual change resets the planner's memory of the tier
        replicas = d.desired


def test_prefill_recommendation_formula():
    # (arrival 3000 + backlog 8000 / 2 s) / 1000 per replica = 7
    rec = recommend_prefill(PrefillSignals(8000, 3000, 1000), current=2, ttft_slo_s=2.0)
    assert rec.replicas == 7
    # Exactly at capacity: no float noise rounding up.
    assert recommend_prefill(PrefillSignals(0, 3000, 1000), 3, 2.0).replicas == 3
    assert recommend_prefill(PrefillSignals(0, 0, 1000), 3, 2.0).replicas == 0
    # TTFT over the SLO with a backlog asks for one more even when the formula says enough.
    rec = recommend_prefill(PrefillSignals(100, 1000, 1000, ttft_s=3.5), current=2, ttft_slo_s=2.0)
    assert rec.replicas == 3 and "TTFT" in rec.reason
    with pytest.raises(ValueError):
        recommend_prefill(PrefillSignals(1, 1, 0), 1, 2.0)


def test_decode_recommendation_formula():
    assert recommend_decode(DecodeSignals(0.9), 4, 0.75, 0.1).replicas == 5  # ceil(4 * 1.2) = 5 (4.8)
    assert recommend_decode(DecodeSignals(0.78), 4, 0.75, 0.1).replicas == 4  # within 10 %
    assert recommend_decode(DecodeSignals(0.3), 4, 0.75, 0.1).replicas == 2  # ceil(1.6)
    # TPOT 0.15 s against 0.1 s outweighs a low KV usage: ceil(4 * 1.5) = 6.
    rec = recommend_decode(DecodeSignals(0.3, tpot_s=0.15), 4, 0.75, 0.1)
    assert rec.replicas == 6 and "TPOT" in rec.reason
    assert recommend_decode(DecodeSignals(None), 3, 0.75, 0.1).replicas == 3
    with pytest.raises(ValueError):
        recommend_decode(DecodeSignals(0.5), 1, 0.0, 0.1)


def test_throughput_is_learned_only_under_load():
    est = ThroughputEstimator(prior=2000, alpha=0.5)
    assert est.update(300, saturated=False) == 2000, "an idle replica's rate is not its capacity"
    assert est.update(1000, saturated=True) == 1000, "the first measurement replaces the prior"
    assert est.update(3000, saturated=True) == 2000
