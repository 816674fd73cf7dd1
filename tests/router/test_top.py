"""``pdserve top`` (pdserve/services/top.py): one ``--once`` frame against the real registry and router (real
redis-server, uvicorn over HTTP) with stand-in pods, compared with the registry's own answer; and the histogram
deltas behind the rolling TTFT, against percentiles computed by hand."""

from __future__ import annotations

import time

import httpx
import pytest
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from pydantic import SecretStr

from pdserve.services.registry.app import create_app as create_registry_app
from pdserve.services.registry.settings import RegistrySettings
from pdserve.services.top import TTFT, Frame, command, latency_rows, parse_metrics
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.worker.metrics import WorkerMetrics

from router_harness import ThreadServer, free_port


def metrics_server(metrics: WorkerMetrics) -> ThreadServer:
    """A stand-in pod's HTTP side: only ``GET /metrics``, serving a real worker's metrics registry."""
    app = FastAPI()

    @app.get("/metrics")
    def page() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain")

    return ThreadServer.start(app)


def register(registry_url: str, **fields) -> None:
    """Registers a pod as its heartbeat would (``Pods.add`` fixes the port and the block counts)."""
    info = PodInfo(host="127.0.0.1", model="smollm2-135m-instruct", **fields)
    httpx.post(registry_url + "/v1/pods", json=info.model_dump(mode="json"), timeout=10).raise_for_status()


def table_rows(text: str, title: str) -> list[list[str]]:
    """The body rows of the rich table titled ``title`` in ``text``: cells stripped."""
    block = text.split("\n" + title, 1)[1]
    body = block.split("┡", 1)[1].split("└", 1)[0]
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in body.splitlines()[1:]
            if line.startswith("│")]


def test_once_shows_the_registry_pods_and_queue(router, redis_client):
    """Pods of both tiers with distinct loads (one of them with a live /metrics), three entries in the prefill
    stream: every row of the frame matches the registry's GET /v1/pods, the queue matches XLEN."""
    worker = WorkerMetrics("decode", "decode-1")
    worker.swapped.set(2)
    worker.ttft.observe(0.03)
    scraped = metrics_server(worker)
    try:
        port = int(scraped.url.rsplit(":", 1)[1])
        register(router.pods.registry_url, pod_id="decode-1", role="decode", http_port=port, kv_port=9001,
                 total_blocks=2000, free_blocks=500, num_running=7, num_waiting=2)
        register(router.pods.registry_url, pod_id="prefill-1", role="prefill", http_port=8002, total_blocks=300,
                 free_blocks=299, num_running=1, num_waiting=4, queued_prefill_tokens=321)
        register(router.pods.registry_url, pod_id="decode-2", role="decode", http_port=free_port(), kv_port=9002,
                 total_blocks=64, free_blocks=0)
        for _ in range(3):
            redis_client.xadd(keys.PREFILL_STREAM, {"x": "1"})
        result = CliRunner().invoke(command, ["--once", "--registry-url", router.pods.registry_url,
                                              "--router-url", router.url])
    finally:
        scraped.stop()
    assert result.exit_code == 0, result.output
    truth = httpx.get(router.pods.registry_url + "/v1/pods", timeout=10).json()["pods"]
    rows = {r[1]: r for r in table_rows(result.output, "pods")}
    assert sorted(rows) == sorted(p["pod_id"] for p in truth) == ["decode-0", "decode-1", "decode-2", "prefill-0",
                                                                                "prefill-1"]
    for p in truth:
        used = p["total_blocks"] - p["free_blocks"]
        usage = 100 * used / p["total_blocks"]
        assert rows[p["pod_id"]][:8] == [p["role"], p["pod_id"], f"http://127.0.0.1:{p['http_port']}",
                                         str(p["num_running"]), str(p["num_waiting"]),
                                         str(p["queued_prefill_tokens"]), f"{used}/{p['total_blocks']}",
                                         f"{usage:.1f}"]
        # heartbeat age: the frame was taken before this read of the registry (ages shown to 0.1 s)
        assert 0 <= float(rows[p["pod_id"]][9]) <= time.time() - p["last_heartbeat"] + 0.1
    assert rows["decode-1"][8] == "2" and rows["decode-1"][10] == "ok"
    assert rows["decode-2"][10] == "unreachable"  # registered with a port nothing serves
    assert [r[1] for r in table_rows(result.output, "pods")] == ["prefill-0", "prefill-1", "decode-0", "decode-1",
                                                                 "decode-2"]
    [phases] = table_rows(result.output, "requests in flight")
    assert phases == ["0", str(redis_client.xlen(keys.PREFILL_STREAM)), "1", "4", "7", "2", "2"]
    assert phases[1] == "3"
    latency = {(r[0], r[1]): r for r in table_rows(result.output, "latency")}
    # decode-1's one observation, 30 ms, in the bucket (20, 40] ms: p50 interpolated at its middle
    assert latency[("decode pods", "TTFT")][2:4] == ["1", "30.0"]


def test_a_token_registry_needs_the_token(redis_url, monkeypatch):
    server = ThreadServer.start(create_registry_app(RegistrySettings(redis_url=redis_url,
                                                                     auth_token=SecretStr("s3cret-token"))))
    try:
        refused = CliRunner().invoke(command, ["--once", "--registry-url", server.url, "--router-url", ""])
        monkeypatch.setenv("PDSERVE_REGISTRY_TOKEN", "s3cret-token")
        accepted = CliRunner().invoke(command, ["--once", "--registry-url", server.url, "--router-url", ""])
    finally:
        server.stop()
    assert refused.exit_code == 1 and "401" in refused.output
    assert accepted.exit_code == 0 and "registry:" not in accepted.output, accepted.output


def _page(observations: list[float]) -> str:
    registry = CollectorRegistry()
    h = Histogram(TTFT, "ttft", ["model_name"], buckets=[0.1, 0.2, 0.4, 0.8], registry=registry).labels("m")
    for x in observations:
        h.observe(x)
    return generate_latest(registry).decode()


def test_rolling_ttft_is_the_percentile_of_the_window():
    # window between the scrapes: 2 in (0.1, 0.2], 4 in (0.2, 0.4], 2 in (0.4, 0.8]; cumulative 0, 2, 6, 8, 8.
    # p50: rank 4 lies in (0.2, 0.4] between cumulative 2 and 6: 0.2 + 0.2 * (4 - 2) / (6 - 2) = 0.3 s.
    # p99: rank 7.92 in (0.4, 0.8] between 6 and 8: 0.4 + 0.4 * 1.92 / 2 = 0.784 s.
    before = [0.05] * 10
    after = before + [0.15] * 2 + [0.3] * 4 + [0.5] * 2
    old, new = parse_metrics(_page(before)), parse_metrics(_page(after))
    window = new.histograms[TTFT].minus(old.histograms[TTFT])
    assert window.count == 8
    assert window.quantile(0.5) == pytest.approx(0.3)
    assert window.quantile(0.99) == pytest.approx(0.784)
    # since start (18 observations, 10 of them in the first bucket): p50 rank 9 -> 0.1 * 9 / 10
    assert new.histograms[TTFT].minus(None).quantile(0.5) == pytest.approx(0.09)
    # a restarted process (count went down): the new histogram is all new
    assert old.histograms[TTFT].minus(new.histograms[TTFT]).count == 10
    # the frame's router row is that window
    rows = latency_rows(Frame([], {}, new, 2.0), Frame([], {}, old, 0.0))
    [(source, metric, h)] = rows
    assert (source, metric, h.quantile(0.5)) == ("router", "TTFT", pytest.approx(0.3))
    # an observation above the last finite bound is reported at that bound, as histogram_quantile does
    assert parse_metrics(_page([5.0])).histograms[TTFT].quantile(0.5) == pytest.approx(0.8)
