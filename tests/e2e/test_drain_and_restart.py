"""Stopping and losing services under ``pdserve up`` (real processes, real signals) loses no request.

* SIGTERM to the router drains it: streams in flight finish, new requests get 503 with Retry-After and
  ``/health`` says ``draining``; a second SIGTERM ends what is left with an error chunk and ``[DONE]``.
* SIGTERM to a decode pod hands its running request to the other pod at once (the router's "error" migration,
  not its stall check); the text equals the offline engine's greedy output.
* SIGKILL of the router orphans nothing: the decode pod drops the request within a bounded time and frees its
  blocks. SIGKILL of the registry or the router stops nothing: ``pdserve up`` starts them again.
* SIGKILL of ``pdserve up``'s own redis-server stops nothing either: up starts it again on the same port with the
  same password, it reloads its append-only file, and a new request is served.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil
import pytest
import redis

from pdserve.loadtest.cluster import Cluster

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a long story about a lighthouse keeper and the sea."
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def ens(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up")
    with Cluster("--colocated", "--decode", "2", "--dtype", "float32", log_dir=log_dir,
                 env={"PDSERVE_POD_TTL_S": "4", "PDSERVE_MIGRATION_STALL_S": "1",
                      "PDSERVE_SHUTDOWN_GRACE_S": "120"}, process=True) as ens:
        yield ens


@pytest.fixture(scope="module")
def offline():
    from pdserve import LLM

    return LLM(MODEL, dtype="float32")


def greedy(offline, max_tokens: int) -> str:
    from pdserve import SamplingParams

    (out,) = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return out.outputs[0].text


def stream(ens: Cluster, max_tokens: int, on_text=None) -> tuple[str, str | None, list[dict]]:
    """Text, finish reason and every data chunk (``[DONE]`` as ``{"done": True}``) of a greedy stream."""
    text, finish, chunks = "", None, []
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{ens.router_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line or line.startswith(":"):
                    continue
                assert line.startswith("data: "), line
                if line == "data: [DONE]":
                    chunks.append({"done": True})
                    continue
                data = json.loads(line[len("data: "):])
                chunks.append(data)
                for choice in data.get("choices", []):
                    text += choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
                if on_text is not None and text:
                    on_text(text)
    return text, finish, chunks


def wait_until(check, timeout_s: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def router_serves(ens: Cluster) -> bool:
    return httpx.get(f"{ens.router_url}/health", timeout=5).status_code == 200 and len(ens.pods("decode")) == 2


def idle(ens: Cluster) -> bool:
    return all(ens.stats(p)["num_running"] == 0 and ens.stats(p)["num_waiting"] == 0 for p in ens.pods("decode"))


def test_sigterm_drains_the_router_then_up_starts_it_again(ens, offline):
    want = greedy(offline, 40)
    seen: dict = {}

    def sigterm_once(text: str) -> None:
        if seen:
            return
        os.kill(ens.child_pid("router"), signal.SIGTERM)
        time.sleep(0.5)
        seen["health"] = httpx.get(f"{ens.router_url}/health", timeout=10)
        seen["new"] = httpx.post(f"{ens.router_url}/v1/completions", timeout=10,
                                 json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})

    text, finish, chunks = stream(ens, 40, sigterm_once)
    assert (text, finish) == (want, "length") and chunks[-1] == {"done": True}
    assert (seen["health"].status_code, seen["health"].json()) == (503, {"status": "draining"})
    new = seen["new"]
    assert new.status_code == 503 and new.headers["retry-after"] == "1"
    assert new.json()["error"] == {"message": "The server is shutting down; retry the request",
                                   "type": "ServiceUnavailableError", "param": None, "code": 503}
    wait_until(lambda: "pdserve up: router exited with status" in (ens.log_dir / "up.out").read_text(), 60,
               "the drained router exits")
    wait_until(lambda: router_serves(ens), 180, "the router is started again")
    assert stream(ens, 40)[0] == want


def test_a_second_sigterm_ends_the_rest_with_an_error_chunk_and_done(ens):
    wait_until(lambda: router_serves(ens), 180, "router up")
    sent: dict = {}

    def sigterm_twice(text: str) -> None:
        if not sent:
            pid = sent["pid"] = ens.child_pid("router")
            os.kill(pid, signal.SIGTERM)
            time.sleep(0.3)
            os.kill(pid, signal.SIGTERM)

    text, finish, chunks = stream(ens, 600, sigterm_twice)
    assert finish is None and text
    assert chunks[-1] == {"done": True}
    assert chunks[-2] == {"error": {"message": "The server is shutting down; retry the request",
                                    "type": "ServiceUnavailableError", "param": None, "code": 503}}
    wait_until(lambda: idle(ens), 30, "the cut request is aborted on its decode pod")


def test_a_sigtermed_decode_pod_hands_its_request_over(ens, offline):
    wait_until(lambda: router_serves(ens) and idle(ens), 180, "ensemble idle")
    want = greedy(offline, 48)

    def migrations() -> float:
        text = httpx.get(f"{ens.router_url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdserve:request_migrations_total") and 'reason="error"' in line)

    before = migrations()
    victim: dict = {}

    def sigterm_once(text: str) -> None:
        if victim or len(text) < 20:
            return
        busy = [p for p in ens.pods("decode") if ens.stats(p)["num_running"] > 0]
        assert len(busy) == 1
        victim.update(busy[0])
        os.kill(ens.child_pid("decode", victim["pod_id"]), signal.SIGTERM)

    text, finish, _ = stream(ens, 48, sigterm_once)
    assert victim and (text, finish) == (want, "length")
    assert migrations() == before + 1  # handed over at once (a 503 from the pod), not found by the stall check
    log = (ens.log_dir / f"{victim['pod_id']}.log").read_text()
    assert "shutting down: handing 1 requests over to other decode pods" in log


def test_a_killed_router_leaves_no_orphan_and_comes_back(ens):
    wait_until(lambda: router_serves(ens) and idle(ens), 180, "ensemble idle")
    blocks = {p["pod_id"]: ens.stats(p)["kv_blocks_used"] for p in ens.pods("decode")}
    killed: dict = {}

    def kill_once(text: str) -> None:
        if not killed:
            killed["at"] = time.monotonic()
            os.kill(ens.child_pid("router"), signal.SIGKILL)

    with pytest.raises(httpx.HTTPError):
        stream(ens, 700, kill_once)
    wait_until(lambda: idle(ens), 40, "the orphan is dropped")
    assert time.monotonic() - killed["at"] < 40  # 700 tokens would take far longer on these CPUs
    for pod in ens.pods("decode"):
        assert ens.stats(pod)["kv_blocks_used"] <= blocks.get(pod["pod_id"], 0)
    orphaned = sum(float(line.rsplit(" ", 1)[1]) for pod in ens.pods("decode")
                   for line in httpx.get(f"http://{pod['host']}:{pod['http_port']}/metrics", timeout=10).text.splitlines()
                   if line.startswith("pdserve:requests_orphaned_total"))
    assert orphaned == 1
    wait_until(lambda: router_serves(ens), 180, "the router is started again")
    assert "pdserve up: router exited with status -9; restarting it" in (ens.log_dir / "up.out").read_text()


def test_a_killed_registry_stops_nothing(ens, offline):
    wait_until(lambda: router_serves(ens) and idle(ens), 180, "ensemble idle")
    want = greedy(offline, 32)
    killed: dict = {}

    def kill_once(text: str) -> None:
        if not killed:
            killed["pid"] = ens.child_pid("registry")
            os.kill(killed["pid"], signal.SIGKILL)

    text, finish, _ = stream(ens, 32, kill_once)
    assert (text, finish) == (want, "length")  # the stream in flight needs no registry
    # Between the kill and the restart there is no registry process at all: keep waiting then.
    wait_until(lambda: ens.find_child_pid("registry") not in (None, killed["pid"]) and router_serves(ens), 180,
               "the registry is started again and the pods are listed")
    assert "pdserve up: registry exited with status -9; restarting it" in (ens.log_dir / "up.out").read_text()
    assert stream(ens, 32)[0] == want
    assert ens.proc.poll() is None


def redis_pid(ens: Cluster) -> int | None:
    """The pid of ``pdserve up``'s own redis-server (it rewrites its title, so by name), or None between a kill
    and the restart."""
    for proc in psutil.Process(ens.proc.pid).children(recursive=True):
        try:
            if proc.name().startswith("redis-server") or "redis-server" in " ".join(proc.cmdline()):
                return proc.pid
        except psutil.NoSuchProcess:
            continue
    return None


def test_a_killed_embedded_redis_is_restarted_with_its_data_and_serving_comes_back(ens, offline):
    wait_until(lambda: router_serves(ens) and idle(ens), 180, "ensemble idle")
    want = greedy(offline, 16)
    r = redis.Redis.from_url(ens.redis_url, socket_timeout=5)
    r.set("test:aof-kept", "yes")
    time.sleep(2)  # appendfsync everysec: the write reaches the append-only file within a second
    killed = redis_pid(ens)
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    # up starts it again (same port and password) instead of stopping everything; the services reconnect
    wait_until(lambda: redis_pid(ens) not in (None, killed) and router_serves(ens), 180,
               "Redis is started again and the router serves with both decode pods")
    out = (ens.log_dir / "up.out").read_text()
    assert "pdserve up: redis exited with status -9; restarting it" in out, out[-3000:]
    assert "stopping everything" not in out
    assert r.get("test:aof-kept") == b"yes"  # the append-only file came back with it
    text, finish, _ = stream(ens, 16)
    assert (text, finish) == (want, "length")
    assert ens.proc.poll() is None
