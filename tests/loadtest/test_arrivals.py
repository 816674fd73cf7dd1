"""The gamma arrival process has the requested mean rate and coefficient of variation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.loadtest.arrivals import arrival_times, gamma_intervals


@pytest.mark.parametrize("rate,burstiness", [(4.0, 1.0), (20.0, 0.25), (0.5, 4.0)])
def test_gamma_gaps_have_requested_mean_rate_and_cv(rate, burstiness):
    gaps = gamma_intervals(200_000, rate, burstiness, seed=7)
    assert 1.0 / gaps.mean() == pytest.approx(rate, rel=0.02)
    # Gamma(k, theta): CV = 1/sqrt(k); burstiness 1 is Poisson (CV 1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.03)


def test_arrival_times_start_at_zero_and_accumulate_without_drift():
    t = arrival_times(1000, 10.0, 1.0, seed=1)
    assert t[0] == 0.0 and len(t) == 1000
    assert np.all(np.diff(t) >= 0)
    assert np.allclose(np.diff(t), gamma_intervals(999, 10.0, 1.0, seed=1))


def test_infinite_rate_sends_everything_at_once():
    assert np.all(arrival_times(50, math.inf) == 0.0)


def test_same_seed_same_schedule_other_seed_other_schedule():
    a, b, c = (arrival_times(100, 5.0, 1.0, s) for s in (3, 3, 4))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_non_positive_rate_is_refused():
    with pytest.raises(ValueError):
        gamma_intervals(10, -1.0)
