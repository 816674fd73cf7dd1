"""A short real ``bench serve`` run against the embedded ensemble (``pdserve up``, the real model)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pdserve.loadtest.cli import bench
from pdserve.loadtest.cluster import Cluster
from pdserve.loadtest.pd_compare import up_unavailable_reason

from test_serve_mock import VLLM_KEYS

MODEL = "smollm2-135m-instruct"


@pytest.mark.slow
def test_serve_against_pdserve_up_writes_every_key(tmp_path):
    reason = up_unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "up.json"
    with Cluster("--model", MODEL, log_dir=tmp_path / "up", timeout_s=600, process=True,
                 serving_model=MODEL) as cluster:
        url = cluster.router_url
        r = CliRunner().invoke(bench, [
            "serve", "--disable-tqdm", "--base-url", url, "--model", MODEL, "--num-prompts", "4",
            "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos", "--request-rate", "2",
            "--goodput", "ttft:60000", "tpot:60000", "--save-result", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    print(r.output)
    res = json.loads(out.read_text())
    assert [k for k in VLLM_KEYS if k not in res] == []
    assert res["completed"] == 4 and res["failed"] == 0
    assert res["output_lens"] == [8] * 4  # ignore_eos: every request decodes its whole budget
    assert all(n >= 16 for n in res["input_lens"])
    assert 0 < res["mean_ttft_ms"] <= res["mean_e2el_ms"]
    assert res["mean_tpot_ms"] > 0 and res["request_goodput"] == pytest.approx(res["request_throughput"])
