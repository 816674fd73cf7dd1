"""Command-line parsing shared by serve and sweep: vLLM-style --goodput, SLO lists, validation."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.options import GreedyCommand, parse_slos
from pdserve.loadtest.slo import SloSpec, evaluate, slo_capacity
from pdserve.loadtest.timeline import RequestRecord


def test_goodput_takes_several_values_like_vllm():
    seen = {}

    @click.command(cls=GreedyCommand)
    @click.option("--goodput", multiple=True)
    @click.option("--num-prompts", type=int)
    def cmd(goodput, num_prompts):
        seen["goodput"], seen["n"] = goodput, num_prompts

    r = CliRunner().invoke(cmd, ["--goodput", "ttft:500", "tpot:50", "--num-prompts", "3", "--goodput=e2el:9"])
    assert r.exit_code == 0, r.output
    assert seen == {"goodput": ("ttft:500", "tpot:50", "e2el:9"), "n": 3}
    assert parse_slos(seen["goodput"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 9.0}
    assert parse_slos(("ttft:1,tpot:2",)) == {"ttft": 1.0, "tpot": 2.0}


@pytest.mark.parametrize("value,message", [
    ("latency:5", "--goodput: expected KEY:MS with KEY in ttft, tpot, e2el, got 'latency:5'"),
    ("ttft:abc", "--goodput: ttft must be a number of milliseconds, got 'abc'"),
    ("ttft:-3", "--goodput: ttft must be a positive number of milliseconds, got -3"),
])
def test_bad_goodput_names_the_problem(value, message):
    with pytest.raises(LoadTestError) as e:
        parse_slos((value,))
    assert str(e.value) == message


def _rec(ttft, latency, n, ok=True):
    return RequestRecord(index=0, success=ok, status="200" if ok else "500", ttft=ttft, latency=latency,
                         output_tokens=n, chunk_tokens=[1] * n if ok else [])


def test_attainment_and_percentile_slos():
    # 9 requests within 100 ms TTFT / 10 ms TPOT, one over on TTFT
    recs = [_rec(0.05, 0.05 + 0.009 * 9, 10) for _ in range(9)] + [_rec(0.5, 0.5 + 0.009 * 9, 10)]
    spec = SloSpec(ttft_ms=100, tpot_ms=10, attainment=0.9)
    r = evaluate(spec, recs)
    assert r["slo_attainment"] == pytest.approx(0.9) and r["slo_pass"]
    assert not evaluate(SloSpec(100, 10, attainment=0.95), recs)["slo_pass"]
    # at p99 the slow request decides
    p = evaluate(SloSpec(100, 10, mode="percentile", percentile=99), recs)
    assert p["slo_p_ttft_ms"] == pytest.approx(500) and not p["slo_pass"]
    # a failed request counts as missed
    assert evaluate(spec, recs[:9] + [_rec(0, 0, 0, ok=False)])["slo_attainment"] == pytest.approx(0.9)


def test_slo_capacity_is_highest_rate_before_first_failure():
    pts = [{"offered_rate": r, "slo_pass": ok} for r, ok in [(4, False), (1, True), (2, True), (8, True)]]
    assert slo_capacity(pts) == 2
    assert slo_capacity([{"offered_rate": 1, "slo_pass": False}]) is None
