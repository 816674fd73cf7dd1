"""``PrefillRate``: prompt tokens per busy second over a window of the engine's running totals."""

from pdserve.services.prefill.rate import PrefillRate


def test_the_rate_follows_the_last_window_and_falls_back_to_the_whole_life_when_idle():
    rate = PrefillRate(window_s=10.0)
    assert rate.tokens_per_s() == 0.0  # nothing measured: routers use --prefill-tokens-per-s
    rate.add(0.0, 0, 0.0)
    rate.add(5.0, 5000, 5.0)  # 1000 tokens per busy second
    assert rate.tokens_per_s() == 1000.0
    rate.add(20.0, 6000, 15.0)  # the host got busy: 1000 tokens in 10 busy seconds
    rate.add(25.0, 6500, 20.0)
    assert rate.tokens_per_s() == 100.0  # the window holds (20, 6000, 15) .. (25, 6500, 20) and the one before
    rate.add(40.0, 6500, 20.0)
    rate.add(60.0, 6500, 20.0)  # idle since: no busy time in the window, the whole life's ratio
    assert rate.tokens_per_s() == 6500 / 20.0
