"""The planner process: settings from the chart's environment, /health and /metrics, the CLI entry."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from pydantic import ValidationError

from pdserve.services.planner.app import PlannerLoop, create_app
from pdserve.services.planner.main import planner as planner_command
from pdserve.services.planner.metrics import PlannerMetrics
from pdserve.services.planner.settings import PlannerSettings


class StubPlanner:
    """Only the loop and the HTTP surface are under test here; real rounds are in test_planner_round.py."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.rounds = 0
        self.metrics = PlannerMetrics()

    def run_once(self):
        self.rounds += 1
        self.metrics.rounds.inc()
        if self.fail:
            raise RuntimeError("API server unreachable")
        return []


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_health_ok_and_metrics_while_rounds_succeed():
    stub = StubPlanner(fail=False)
    with TestClient(create_app(PlannerLoop(stub, interval_s=0.05, health_grace_s=5))) as client:
        wait_for(lambda: stub.rounds >= 2)
        resp = client.get("/health")
        assert (resp.status_code, resp.json()) == (200, {"status": "ok"})
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
        assert "pdserve:planner_rounds_total" in metrics.text


def test_health_503_with_the_reason_when_rounds_keep_failing():
    stub = StubPlanner(fail=True)
    loop = PlannerLoop(stub, interval_s=0.05, health_grace_s=0.2)
    with TestClient(create_app(loop)) as client:
        wait_for(lambda: client.get("/health").status_code == 503)
        body = client.get("/health").json()
        assert body["status"] == "error" and "API server unreachable" in body["reason"]
        # a failed round does not end the loop. Waited for: the grace counts from the loop's creation, so on a
        # loaded machine /health can say 503 while the first round is still the only one (seen at load 4-5)
        wait_for(lambda: stub.rounds >= 2, timeout_s=2)


def test_settings_read_the_chart_environment(monkeypatch):
    env = {
        "PDSERVE_NAMESPACE": "llm", "PDSERVE_PREFILL_DEPLOYMENT": "demo-pdserve-prefill",
        "PDSERVE_PREFILL_MAX_REPLICAS": "6", "PDSERVE_TTFT_SLO_SECONDS": "1.5", "PDSERVE_DRY_RUN": "true",
        "PDSERVE_DECODE_SCALE_DOWN_STABILIZATION_SECONDS": "900", "REDIS_URL": "redis://r:6379/1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = PlannerSettings()
    assert (s.namespace, s.prefill_deployment, s.prefill_max_replicas, s.ttft_slo_seconds, s.dry_run) == (
        "llm", "demo-pdserve-prefill", 6, 1.5, True)
    assert s.redis_url == "redis://r:6379/1"
    assert s.policy("decode").scale_down_stabilization_s == 900


def test_settings_refuse_min_above_max():
    with pytest.raises(ValidationError, match="prefill_min_replicas"):
        PlannerSettings(prefill_min_replicas=5, prefill_max_replicas=2)


def test_the_planner_command_documents_its_flags():
    result = CliRunner().invoke(planner_command, ["--help"])
    assert result.exit_code == 0
    for flag in ("--ttft-slo-seconds", "--tpot-slo-seconds", "--target-kv-cache-usage", "--dry-run", "--namespace"):
        assert flag in result.output
