"""Fixtures for the planner tests: a stand-in Kubernetes API (no API server can run here), a real
redis-server, and real HTTP servers that serve Prometheus text the way the tiers' pods do."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes import client as k8s

from fake_kube import FakeDeployment, FakeKube, FakeKubeServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support (shared test helpers)
from support.redis_server import RedisServer  # noqa: E402


@pytest.fixture
def kube() -> Iterator[tuple[FakeKube, k8s.ApiClient]]:
    state = FakeKube(namespace="llm", deployments={
        "demo-pdserve-prefill": FakeDeployment(2, {"app.kubernetes.io/component": "prefill", "app.kubernetes.io/instance": "demo"}),
        "demo-pdserve-decode": FakeDeployment(2, {"app.kubernetes.io/component": "decode", "app.kubernetes.io/instance": "demo"}),
        "demo-pdserve-router": FakeDeployment(2, {"app.kubernetes.io/component": "router", "app.kubernetes.io/instance": "demo"}),
    })
    # As the chart's Role: scale only for the tiers the planner sizes (tests/helm checks the Role says so).
    state.scale_allowed = {"demo-pdserve-prefill", "demo-pdserve-decode"}
    with FakeKubeServer(state) as server:
        cfg = k8s.Configuration(host=server.url)
        with k8s.ApiClient(cfg) as api:
            yield state, api


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


class MetricsServer:
    """GET /metrics returns ``self.text`` (what a pod would export); real HTTP on a free loopback port."""

    def __init__(self) -> None:
        self.text = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                data = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def metrics_servers() -> Iterator[dict[str, MetricsServer]]:
    servers = {tier: MetricsServer() for tier in ("prefill", "decode", "router")}
    yield servers
    for s in servers.values():
        s.close()
