"""``bench sweep``, ``bench client-overhead`` and ``bench pd-vs-colocated`` end to end."""

from __future__ import annotations

import json
import math
import sys

import pytest
from click.testing import CliRunner

from pdserve.loadtest.cli import bench
from pdserve.loadtest.pd_compare import interleave, ratios, split_counts, up_unavailable_reason

from loadtest_support import TOKENIZER


def run(*args: str):
    return CliRunner().invoke(bench, list(args), catch_exceptions=False)


@pytest.mark.slow
def test_sweep_reports_slo_capacity_and_plots(mock, tmp_path):
    out = tmp_path / "sweep"
    r = run("sweep", "--disable-tqdm", "--base-url", mock.url, "--tokenizer", TOKENIZER, "--num-prompts", "6",
            "--random-input-len", "8", "--random-output-len", "4", "--request-rates", "5,20",
            "--slo", "ttft:60000", "tpot:60000", "--output-dir", str(out))
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "sweep.json").read_text())
    assert [p["offered_rate"] for p in summary["points"]] == [5.0, 20.0]
    assert all(p["slo_pass"] and p["slo_attainment"] == 1.0 for p in summary["points"])
    assert summary["slo_capacity"] == 20.0
    assert summary["slo"] == {"name": "custom", "ttft_ms": 60000.0, "tpot_ms": 60000.0, "mode": "attainment",
                              "attainment": 0.9, "percentile": None}
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "rate-5.json").exists() and (out / "rate-20.json").exists()
    assert "SLO capacity (custom" in r.output and "20 req/s" in r.output


@pytest.mark.slow
def test_each_sweep_run_has_its_own_prompts(mock, tmp_path, monkeypatch):
    # the server keeps earlier runs' prompts in its prefix cache: a rate point that repeated them (the saturation
    # run's, or the previous rate's) would measure cached prefills
    from pdserve.loadtest import benchmark

    seen, real = [], benchmark.run_prepared

    async def recording(opts, info, requests, rate=None, **kw):
        seen.append(tuple(r.prompt for r in requests))
        return await real(opts, info, requests, rate, **kw)

    monkeypatch.setattr(benchmark, "run_prepared", recording)
    r = run("sweep", "--disable-tqdm", "--base-url", mock.url, "--tokenizer", TOKENIZER, "--num-prompts", "3",
            "--random-input-len", "8", "--random-output-len", "2", "--saturation", "--num-rates", "2",
            "--slo", "ttft:60000", "tpot:60000", "--output-dir", str(tmp_path / "sweep"))
    assert r.exit_code == 0, r.output
    assert len(seen) == 3 and len({p for prompts in seen for p in prompts}) == 3 * 3


@pytest.mark.slow
def test_sweep_with_impossible_slo_has_no_capacity(mock, tmp_path):
    out = tmp_path / "sweep"
    r = run("sweep", "--disable-tqdm", "--base-url", mock.url, "--tokenizer", TOKENIZER, "--num-prompts", "4",
            "--random-input-len", "8", "--random-output-len", "4", "--saturation", "--num-rates", "2",
            "--slo-preset", "mlperf-interactive", "--output-dir", str(out))
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "sweep.json").read_text())
    # the mock's TTFT is 50 ms and TPOT 10 ms: inside 450/40 ms at p99
    assert summary["slo"]["name"] == "mlperf-interactive" and summary["slo"]["percentile"] == 99.0
    assert summary["saturation_request_throughput"] > 0 and len(summary["points"]) == 2
    assert all(p["slo_p_ttft_ms"] >= 50 for p in summary["points"])


@pytest.mark.slow
def test_sweep_argument_errors_are_one_line(mock):
    r = run("sweep", "--base-url", mock.url, "--slo", "ttft:1", "tpot:1")
    assert r.exit_code == 1 and r.output.splitlines() == [
        "Error: give exactly one of --request-rates R1,R2,... and --saturation"]
    r = run("sweep", "--base-url", mock.url, "--request-rates", "1", "--slo", "ttft:1")
    assert r.output.splitlines() == ["Error: --slo needs both ttft:MS and tpot:MS (or use --slo-preset)"]
    r = run("sweep", "--base-url", mock.url, "--request-rates", "1,-2", "--slo", "ttft:1", "tpot:1")
    assert r.output.splitlines() == ["Error: --request-rates must be positive numbers or inf, got '1,-2'"]


@pytest.mark.slow
def test_client_overhead_reports_sustained_rate(tmp_path):
    out = tmp_path / "overhead.json"
    r = run("client-overhead", "--num-prompts", "200", "--max-concurrency", "16", "--output-len", "8",
            "--disable-tqdm", "--save-result", str(out))
    assert r.exit_code == 0, r.output
    print(r.output)  # the figure is reported, not asserted
    res = json.loads(out.read_text())
    assert res["completed"] == 200 and res["total_output_tokens"] == 1600
    assert res["max_concurrent_requests"] <= 16
    assert "sustained request rate:" in r.output


def test_interleave_puts_a_long_request_every_k():
    assert interleave(["s"] * 6, ["L"] * 2, 4) == ["s", "s", "s", "L", "s", "s", "s", "L"]
    assert interleave(["s"] * 2, ["L"] * 3, 2) == ["s", "L", "s", "L", "L"]


def test_mix_splits_the_requests_into_short_and_long():
    assert split_counts(48, 4, "mixed") == (36, 12)
    assert split_counts(48, 4, "short") == (48, 0)
    assert split_counts(48, 4, "long") == (0, 48)
    assert interleave([], ["L"] * 3, 4) == ["L"] * 3 and interleave(["s"] * 3, [], 4) == ["s"] * 3


def test_ratios_are_disaggregated_over_colocated():
    def row(ttft, tpot, tps, label="short"):
        return {"output_throughput": tps, "by_label": {label: {"median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
                                                              "p99_tpot_ms": tpot}}}
    r = ratios({"disaggregated": row(300.0, 50.0, 40.0), "colocated": row(200.0, 100.0, 50.0)})
    assert r == {"short p50 TTFT": 1.5, "short p99 TTFT": 1.5, "short p99 TPOT": 0.5, "out tok/s": 0.8}
    r = ratios({"disaggregated": row(1.0, 1.0, 40.0, "long"), "colocated": row(1.0, 1.0, 20.0, "long")})
    assert r["out tok/s"] == 2.0 and math.isnan(r["short p50 TTFT"])


def test_pd_vs_colocated_explains_when_up_is_missing():
    reason = up_unavailable_reason()
    if reason is None:
        pytest.skip("`pdserve up` exists: the real comparison test covers it")
    r = run("pd-vs-colocated", "--num-prompts", "8")
    assert r.exit_code == 1 and r.output.splitlines() == [f"Error: {reason}"]


@pytest.mark.slow
def test_pd_vs_colocated_against_the_embedded_ensemble(tmp_path):
    reason = up_unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "pd.json"
    r = run("pd-vs-colocated", "--num-prompts", "8", "--long-every", "4", "--short-input-len", "16",
            "--short-output-len", "8", "--long-input-len", "256", "--long-output-len", "2", "--request-rate", "2",
            "--disable-tqdm", "--save-result", str(out))
    assert r.exit_code == 0, r.output
    print(r.output)
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"disaggregated", "colocated"}
    for res in modes.values():
        assert res["completed"] == 8 and res["failed"] == 0
        assert set(res["by_label"]) == {"short", "long"}
        assert res["by_label"]["short"]["total_output_tokens"] <= 6 * 8
        assert res["p99_ttft_ms"] > 0


@pytest.mark.slow
def test_pd_vs_colocated_runs_both_modes_and_prints_one_table(tmp_path):
    # `pdserve up` stands in as two mock servers with different speeds (the ensemble has its own test
    # below); everything else is the real command: start on free ports, wait for /health, run, SIGTERM.
    mock = ("{python} -m pdserve.loadtest.cli mock-server --port {{port}} --model {{model}} "
            f"--tokenizer {TOKENIZER} ").format(python=sys.executable)
    out = tmp_path / "pd.json"
    r = run("pd-vs-colocated", "--model", TOKENIZER, "--num-prompts", "8", "--long-every", "4",
            "--short-input-len", "16", "--short-output-len", "6", "--long-input-len", "64", "--long-output-len", "2",
            "--request-rate", "inf", "--disable-tqdm", "--save-result", str(out),
            "--launch", "disaggregated=" + mock + "--ttft-ms 10 --token-rate 500",
            "--launch", "colocated=" + mock + "--ttft-ms 40 --token-rate 50")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("mode"))
    assert "short p99 TPOT" in lines[header] and "long p99 TTFT" in lines[header]
    assert [ln.split()[0] for ln in lines[header + 2:header + 4]] == ["disaggregated", "colocated"]
    modes = json.loads(out.read_text())["modes"]
    for res in modes.values():
        assert res["completed"] == 8 and res["failed"] == 0
        assert res["by_label"]["short"]["completed"] == 6 and res["by_label"]["long"]["completed"] == 2
        assert res["by_label"]["long"]["total_input_tokens"] == 2 * 64
    # the colocated stand-in decodes at 50 tok/s: every short request takes >= 40 + 5 * 20 ms end to end
    assert min(modes["colocated"]["ttfts"]) >= 0.040
    assert modes["colocated"]["by_label"]["short"]["mean_e2el_ms"] >= 140.0


def test_launch_must_name_a_mode():
    r = run("pd-vs-colocated", "--launch", "fast=python x")
    assert r.exit_code == 1 and r.output.splitlines() == [
        "Error: --launch: expected MODE=COMMAND with MODE in disaggregated, colocated, got 'fast=python x'"]
