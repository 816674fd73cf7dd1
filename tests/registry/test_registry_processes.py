"""Two real registry processes (``pdserve registry``) on one real Redis give the same answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from support.redis_server import free_port

from pdserve.shared.protocol.registry import PodInfo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def start_registry(redis_url: str, port: int, log_path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.services.cli", "registry", "--host", "127.0.0.1", "--port", str(port),
         "--redis-url", redis_url, "--pod-ttl-s", "5"],
        stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env={**os.environ, "PDSERVE_LOG_LEVEL": "warning"},
    )


def wait_healthy(proc: subprocess.Popen, url: str, log_path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"registry exited: {open(log_path).read()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"registry at {url} not healthy: {open(log_path).read()[-2000:]}")


def test_two_registry_processes_on_one_redis_agree(redis_url, tmp_path):
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"registry-{i}.log" for i in range(2)]
    procs = [start_registry(redis_url, p, log) for p, log in zip(ports, logs)]
    a, b = (f"http://127.0.0.1:{p}" for p in ports)
    try:
        for proc, url, log in zip(procs, (a, b), logs):
            wait_healthy(proc, url, log)
        info = PodInfo(pod_id="decode-7", role="decode", host="127.0.0.1", http_port=8003, kv_port=9000,
                       model="smollm2-135m-instruct", total_blocks=64, free_blocks=60)
        stored = httpx.post(f"{a}/v1/pods", json=info.model_dump(mode="json")).json()
        listed_a = httpx.get(f"{a}/v1/pods", params={"role": "decode"}).json()
        listed_b = httpx.get(f"{b}/v1/pods", params={"role": "decode"}).json()
        assert listed_a == listed_b == {"pods": [stored]}
        assert httpx.delete(f"{b}/v1/pods/decode-7").json() == {"deleted": True}
        assert httpx.get(f"{a}/v1/pods").json() == {"pods": []}
        assert httpx.get(f"{a}/v1/pods/decode-7").status_code == 404
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it (exit status -15)
    assert all(proc.returncode in (0, -15) for proc in procs)
    assert all("Traceback" not in log.read_text() for log in logs)
