"""``pdserve top`` (pdserve/services/top.py): one ``--once`` frame against the real registry and router (real
redis-server, uvicorn over HTTP) with stand-in pods, compared with the registry's own answer; and the histogram
deltas behind the rolling TTFT, against percentiles computed by hand."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from pydantic import SecretStr

from pdserve.loadtest.sse import read_chunks
from pdserve.services.registry.app import create_app as create_registry_app
from pdserve.services.router.settings import RouterSettings
from pdserve.services.registry.settings import RegistrySettings
from pdserve.services.top import TTFT, Frame, command, latency_rows, parse_metrics
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.worker.metrics import WorkerMetrics
from pdserve.shared.worker.output_writer import OutputWriter

from router_harness import ThreadServer, free_port, start_router
from test_disconnect import wait_until


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


def _read_entry(r, stream: str, group: str, consumer: str) -> PrefillRequest:
    """Takes the next entry of ``stream`` as a worker would (it stays pending with ``consumer``)."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except Exception:
        pass  # BUSYGROUP
    [(_, [(_, fields)])] = r.xreadgroup(group, consumer, {stream: ">"}, count=1, block=5000)
    return PrefillRequest.decode(fields)


def test_once_lists_each_request_in_flight_with_its_phase(redis_url, registry_url, processor, pods, redis_client,
                                                          prompt_of):
    """Five streamed requests held at known points of their way, played by hand on Redis as the workers would:
    one waiting in the prefill queue; one whose entry a prefill worker took; one whose first token the prefill pod
    sent (the KV hand-over); one with three tokens from the decode pod; a short prompt prefilled by the decode pod
    itself with one token. The frame's request rows are what was set up, and what GET /v1/pdserve/requests says."""
    settings = RouterSettings(redis_url=redis_url, registry_url=registry_url, registry_cache_s=0.0,
                              local_prefill_threshold=100, migration_stall_s=0, prefill_stall_s=0)
    server = start_router(settings, processor, pods)
    writer = OutputWriter(redis_client)
    clients: list[threading.Thread] = []
    relayed: dict[str, list[str]] = {}

    def send(name: str, n_prompt: int) -> None:
        def run() -> None:
            body = {"model": "smollm2-135m-instruct", "prompt": prompt_of(n_prompt), "max_tokens": 50,
                    "stream": True}
            try:
                with httpx.stream("POST", server.url + "/v1/completions", json=body,
                                  headers={"X-Request-Id": name}, timeout=30) as resp:
                    for chunk in read_chunks(resp.iter_lines()):
                        relayed.setdefault(name, []).append(chunk["choices"][0]["text"])
            except httpx.HTTPError:
                pass  # the router stopped under it: the end of the test
        clients.append(threading.Thread(target=run, daemon=True))
        clients[-1].start()

    def emit(req: PrefillRequest, count: int) -> None:
        writer.route(req.request_id, req.router_id)  # as a worker does when it takes the request
        for i in range(count):
            writer.write(OutputEvent(req.request_id, 0, [1000 + i], f" t{i}", prompt_tokens=len(req.prompt_token_ids),
                                     completion_tokens=i + 1))
        assert wait_until(lambda: len(relayed.get(req.request_id.split("-")[1], [])) >= count)

    try:
        taken = {}
        for name in ("prefilling", "transferring", "decoding"):
            send(name, 120)
            taken[name] = _read_entry(redis_client, keys.PREFILL_STREAM, keys.PREFILL_GROUP, "prefill-0")
        emit(taken["transferring"], 1)
        emit(taken["decoding"], 3)
        send("local", 20)
        local = _read_entry(redis_client, keys.decode_stream("decode-0"), keys.DECODE_GROUP, "decode-0")
        emit(local, 1)
        send("queued", 120)
        assert wait_until(lambda: redis_client.xlen(keys.PREFILL_STREAM) == 4)
        result = CliRunner().invoke(command, ["--once", "--registry-url", registry_url, "--router-url", server.url])
        truth = httpx.get(server.url + "/v1/pdserve/requests", timeout=10).json()["data"]
    finally:
        server.stop()
        for t in clients:
            t.join(10)
    assert result.exit_code == 0, result.output
    rows = table_rows(result.output, "requests:")
    assert "requests: 1 queued, 1 prefill, 1 transfer, 2 decode" in result.output
    want = [  # id, choice, phase, prompt tokens, output tokens, prefill, pod, migrations (oldest first)
        ["cmpl-prefilling", "0", "prefill", "120", "0", "remote", "prefill-0", "0"],
        ["cmpl-transferring", "0", "transfer", "120", "1", "remote", "decode-0", "0"],
        ["cmpl-decoding", "0", "decode", "120", "3", "remote", "decode-0", "0"],
        ["cmpl-local", "0", "decode", "20", "1", "local", "decode-0", "0"],
        ["cmpl-queued", "0", "queued", "120", "0", "remote", "decode-0", "0"],
    ]
    assert [r[:3] + r[4:] for r in rows] == want
    assert [[t["id"], str(t["index"]), t["phase"], str(t["prompt_tokens"]), str(t["output_tokens"]), t["prefill"],
             t["pod"], str(t["migrations"])] for t in truth] == want
    ages = [float(r[3]) for r in rows]
    assert ages == sorted(ages, reverse=True) and 0 <= ages[-1] and ages[0] < 30
