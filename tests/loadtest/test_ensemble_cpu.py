"""``pdserve bench ensemble-cpu``'s turn order and its bracketed baseline (pure functions; no ensemble starts)."""

import math

from pdserve.loadtest.ensemble_cpu import schedule, summarize


def turn(mode: str, cpu_ms_per_token: float, tokens: int = 1000) -> tuple[str, dict]:
    return mode, {"cpu_seconds": cpu_ms_per_token * tokens / 1e3, "output_tokens": tokens}


def test_every_ensemble_turn_sits_between_two_offline_turns():
    assert schedule(["offline", "disaggregated", "colocated"], 2) == [
        "offline", "disaggregated", "offline", "colocated", "offline", "disaggregated", "offline", "colocated",
        "offline"]
    assert schedule(["colocated"], 2) == ["colocated", "colocated"]
    assert schedule(["offline"], 2) == ["offline", "offline"]


def test_a_drifting_baseline_is_followed_by_the_turns_around_each_ensemble_turn():
    # the offline engine drifts 20 -> 30 -> 40 CPU-ms/tok; each ensemble costs the same as the offline engine
    # at its time (the mean of its neighbours), so each bracketed ratio is 1.0 -- a first-offline baseline
    # would give 1.25 and 1.75, and the pooled ratio (30 / 30) hides the spread
    turns = [turn("offline", 20), turn("disaggregated", 25), turn("offline", 30), turn("colocated", 35),
             turn("offline", 40)]
    s = summarize(turns)
    assert s["disaggregated"]["bracketed_x_offline"] == [1.0]
    assert s["colocated"]["bracketed_x_offline"] == [1.0]
    assert s["offline"]["cpu_ms_per_token"] == 30.0
    assert math.isclose(s["colocated"]["x_offline"], 35 / 30)


def test_a_turn_with_one_offline_neighbour_uses_it_and_without_offline_ratios_are_nan():
    s = summarize([turn("offline", 20), turn("colocated", 30), turn("colocated", 33)])
    assert s["colocated"]["bracketed_x_offline"] == [1.5, 33 / 20]
    assert math.isclose(s["colocated"]["median_x_offline"], (1.5 + 1.65) / 2)
    alone = summarize([turn("colocated", 30)])
    assert alone["colocated"]["bracketed_x_offline"] == [] and math.isnan(alone["colocated"]["median_x_offline"])
