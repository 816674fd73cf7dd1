"""The registry's bearer token, end to end: real ``pdserve registry`` processes on a real redis-server.

Oracles: the registry's error body shape (``pdserve/services/registry/errors.py`` ``error_body``), RFC 6750's
``WWW-Authenticate: Bearer``, and the registry's own state read back with the token (a refused call must
change nothing). The worker side is the ``RegistryClient`` that ``pdserve/shared/worker/base.py`` builds.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.redis_server import free_port

from pdserve.shared.protocol.registry import PodInfo

from pdserve.shared.worker.heartbeat import Heartbeater

from pdserve.shared.registry_client import RegistryAuthError, RegistryClient

pytestmark = [pytest.mark.timeout(120)]

TOKEN = "reg-5b1f0c9e2d7a4f38a6c1e0b9d8f7a6c5"
MISSING = {"error": {"message": "registry authentication required: send 'Authorization: Bearer <token>' "
                                "(PDSERVE_REGISTRY_TOKEN)",
                     "type": "authentication_error", "param": None, "code": "missing_token"}}
INVALID = {"error": {"message": "registry token refused: it is not this registry's token (PDSERVE_REGISTRY_TOKEN)",
                     "type": "authentication_error", "param": None, "code": "invalid_token"}}
HASHES = ["a1" * 16, "b2" * 16, "c3" * 16]


def pod(pod_id: str = "decode-0", role: str = "decode") -> PodInfo:
    return PodInfo(pod_id=pod_id, role=role, host="127.0.0.1", http_port=8003, kv_port=9000 if role == "decode" else 0,
                   model="smollm2-135m-instruct", total_blocks=64, free_blocks=60, started_at=1_700_000_000.0)


# Every route of the registry but /health and /metrics, with a body that would be valid.
CALLS = [
    ("POST", "/v1/pods", pod("evil-0").model_dump(mode="json")),
    ("GET", "/v1/pods", None),
    ("GET", "/v1/pods/decode-0", None),
    ("DELETE", "/v1/pods/decode-0", None),
    ("POST", "/v1/kv/events", {"pod_id": "decode-0", "epoch": "e1", "events": [
        {"seq": 2, "kind": "removed", "block_hashes": HASHES}]}),
    ("POST", "/v1/kv/snapshot", {"pod_id": "decode-0", "epoch": "e1", "seq": 9, "block_hashes": []}),
    ("GET", "/v1/kv/pods/decode-0", None),
    ("POST", "/v1/kv/lookup", {"block_hashes": HASHES, "role": "decode"}),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
]


class RegistryProcess:
    """``python -m pdserve.services.cli registry`` on a free port; ``url`` once /health answers 200."""

    def __init__(self, redis_url: str, log_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        environ = {k: v for k, v in os.environ.items() if k != "PDSERVE_REGISTRY_TOKEN"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.services.cli", "registry", "--host", "127.0.0.1", "--port",
             str(self.port), "--redis-url", redis_url, *args],
            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
            # a TTL no loaded CI machine outlasts: a test's pod must not expire between its calls
            env={**environ, "PDSERVE_LOG_LEVEL": "info", "PDSERVE_POD_TTL_S": "600", **(env or {})})
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"registry exited: {self.log()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"registry not healthy: {self.log()}"
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def secured(redis_url, tmp_path):
    """A registry whose token comes from PDSERVE_REGISTRY_TOKEN, as the chart and ``pdserve up`` give it."""
    registry = RegistryProcess(redis_url, tmp_path / "registry.log", env={"PDSERVE_REGISTRY_TOKEN": TOKEN})
    yield registry
    registry.stop()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def registered(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/pods", headers=bearer(TOKEN), timeout=5).json()["pods"]


REFUSED = [
    ({}, MISSING),
    ({"Authorization": "Basic " + TOKEN}, MISSING),  # not bearer credentials
    ({"Authorization": "Bearer"}, MISSING),  # the scheme without credentials
    ({"Authorization": "Bearer wrong-token"}, INVALID),
    ({"Authorization": f"Bearer {TOKEN[:-1]}"}, INVALID),  # a prefix of the token is not the token
    ({"Authorization": f"Bearer {TOKEN}x"}, INVALID),
]


@pytest.mark.slow
def test_every_route_refuses_a_caller_without_the_token_and_changes_nothing(secured):
    url = secured.url
    httpx.post(f"{url}/v1/pods", json=pod().model_dump(mode="json"), headers=bearer(TOKEN)).raise_for_status()
    r = httpx.post(f"{url}/v1/kv/events", headers=bearer(TOKEN), json={
        "pod_id": "decode-0", "epoch": "e1", "events": [{"seq": 1, "kind": "stored", "block_hashes": HASHES}]})
    assert r.json()["applied"] == 1
    before = registered(url)

    for headers, expected in REFUSED:
        for method, path, body in CALLS:
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=5)
            assert (r.status_code, r.json()) == (401, expected), (headers, method, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer", (method, path)

    # no fake pod, the real one still there with its blocks, nothing learnt from the lookup
    assert registered(url) == before and [p["pod_id"] for p in before] == ["decode-0"]
    kv = httpx.get(f"{url}/v1/kv/pods/decode-0", headers=bearer(TOKEN)).json()
    assert (kv["epoch"], kv["seq"], kv["block_hashes"]) == ("e1", 1, sorted(HASHES))


@pytest.mark.slow
def test_the_token_opens_every_route(secured):
    url, auth = secured.url, bearer(TOKEN)
    stored = httpx.post(f"{url}/v1/pods", json=pod().model_dump(mode="json"), headers=auth).json()
    assert PodInfo.model_validate(stored) == pod().model_copy(update={"last_heartbeat": stored["last_heartbeat"]})
    assert httpx.get(f"{url}/v1/pods", params={"role": "decode"}, headers=auth).json() == {"pods": [stored]}
    assert httpx.get(f"{url}/v1/pods/decode-0", headers=auth).json() == stored
    r = httpx.post(f"{url}/v1/kv/events", headers=auth, json={
        "pod_id": "decode-0", "epoch": "e1", "events": [{"seq": 1, "kind": "stored", "block_hashes": HASHES[:2]}]})
    assert r.json() == {"applied": 1, "seq": 1, "resync": False}
    reply = httpx.post(f"{url}/v1/kv/lookup", json={"block_hashes": HASHES, "role": "decode"}, headers=auth).json()
    assert [(o["pod"]["pod_id"], o["overlap"]) for o in reply["pods"]] == [("decode-0", 2)]
    # the scheme is case-insensitive (RFC 7235)
    lower = {"Authorization": f"bearer {TOKEN}"}
    assert httpx.delete(f"{url}/v1/pods/decode-0", headers=lower).json() == {"deleted": True}
    assert httpx.get(f"{url}/v1/pods", headers=auth).json() == {"pods": []}
    # the token does not hide real errors: 404 and 400 still come with the registry's body
    assert httpx.delete(f"{url}/v1/pods/decode-0", headers=auth).status_code == 404
    bad = httpx.post(f"{url}/v1/pods", json={**pod().model_dump(mode="json"), "http_port": 0}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "http_port"


@pytest.mark.slow
def test_health_and_metrics_stay_open_and_refusals_are_counted_not_logged_with_the_token(secured):
    url = secured.url
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    httpx.get(f"{url}/v1/pods")
    httpx.get(f"{url}/v1/pods", headers=bearer("guess-1"))
    httpx.get(f"{url}/v1/pods", headers=bearer("guess-2"))
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200
    assert 'pdserve:registry_auth_failures_total{reason="missing_token"} 1.0' in metrics.text
    assert 'pdserve:registry_auth_failures_total{reason="invalid_token"} 2.0' in metrics.text
    log = secured.log()
    assert "registry: bearer token required on every path but /health, /metrics" in log
    assert "UNAUTHENTICATED" not in log
    assert "registry: refused GET /v1/pods from 127.0.0.1: missing_token" in log
    assert TOKEN not in log and "guess-1" not in log and "guess-2" not in log


@pytest.mark.slow
def test_the_auth_token_flag_sets_the_token_too(redis_url, tmp_path):
    registry = RegistryProcess(redis_url, tmp_path / "flag.log", "--auth-token", "from-the-flag")
    try:
        assert httpx.get(f"{registry.url}/v1/pods").status_code == 401
        assert httpx.get(f"{registry.url}/v1/pods", headers=bearer("from-the-flag")).json() == {"pods": []}
        assert "from-the-flag" not in registry.log()
    finally:
        registry.stop()


@pytest.mark.slow
def test_without_a_token_the_registry_is_open_and_says_so(redis_url, tmp_path):
    registry = RegistryProcess(redis_url, tmp_path / "open.log")
    try:
        r = httpx.post(f"{registry.url}/v1/pods", json=pod().model_dump(mode="json"))
        assert r.status_code == 200
        # a client with a token talks to an open registry as well (turning auth on is a registry-side change)
        assert [p.pod_id for p in asyncio.run(_list(registry.url, "any-token"))] == ["decode-0"]
        assert "registry: UNAUTHENTICATED (PDSERVE_REGISTRY_TOKEN unset)" in registry.log()
    finally:
        registry.stop()


@pytest.mark.slow
def test_an_empty_token_is_refused_at_startup_not_taken_for_none(redis_url, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "registry", "--port", str(free_port()), "--redis-url",
         redis_url], env={**os.environ, "PDSERVE_REGISTRY_TOKEN": ""}, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "the registry token must not be empty (unset PDSERVE_REGISTRY_TOKEN for no authentication)" in proc.stderr


async def _list(url: str, token: str | None) -> list[PodInfo]:
    async with RegistryClient(url, token=token) as client:
        return await client.list_pods()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_worker_with_the_token_heartbeats_and_one_without_gets_a_clear_error(secured, monkeypatch):
    from pdserve.shared.worker.base import Worker
    from pdserve.shared.worker.settings import WorkerSettings

    # the worker's own client, built from its settings the way a prefill/decode process builds it
    class DecodeRole(Worker):  # the base class names no role of its own; a role subclass does
        role = "decode"

    monkeypatch.setenv("PDSERVE_REGISTRY_TOKEN", TOKEN)
    worker = DecodeRole(WorkerSettings(registry_url=secured.url, redis_url="redis://127.0.0.1:1/0"))
    try:
        stored = await worker.registry.heartbeat(pod())
        assert stored.pod_id == "decode-0" and stored.last_heartbeat is not None
        assert [p.pod_id for p in await worker.registry.list_pods("decode")] == ["decode-0"]
    finally:
        await worker.registry.aclose()
        await worker.redis.aclose()

    async with RegistryClient(secured.url, token="not-the-token") as wrong:
        with pytest.raises(RegistryAuthError) as err:
            await wrong.heartbeat(pod("decode-1"))
    assert err.value.status == 401
    assert str(err.value) == ("registry POST /v1/pods -> 401: the registry token was refused: it is not the "
                              "registry's (check PDSERVE_REGISTRY_TOKEN)")
    async with RegistryClient(secured.url) as none:
        with pytest.raises(RegistryAuthError) as err:
            await none.lookup(HASHES)
    assert str(err.value) == ("registry POST /v1/kv/lookup -> 401: the registry requires a token and none was "
                              "sent (set PDSERVE_REGISTRY_TOKEN to the registry's token)")
    assert [p["pod_id"] for p in registered(secured.url)] == ["decode-0"]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_refused_heartbeat_is_not_retried(secured):
    async with RegistryClient(secured.url, token="not-the-token") as wrong:
        beater = Heartbeater(wrong, pod, interval_s=0.01, max_backoff_s=0.01, deregister_on_stop=False)
        beater.start()
        deadline = time.monotonic() + 30
        while not beater._task.done():
            assert time.monotonic() < deadline, "the heartbeater kept retrying a 401"
            await asyncio.sleep(0.02)
        assert (beater.beats, beater.failures) == (0, 1)
        assert isinstance(beater.refused, RegistryAuthError) and beater.refused.status == 401
        await beater.stop()
    # an outage is still retried: the same heartbeater against an unreachable registry keeps going
    async with RegistryClient(f"http://127.0.0.1:{free_port()}", token=TOKEN, timeout_s=0.5) as gone:
        beater = Heartbeater(gone, pod, interval_s=0.01, max_backoff_s=0.01, deregister_on_stop=False)
        beater.start()
        deadline = time.monotonic() + 30
        while beater.failures < 3:
            assert time.monotonic() < deadline and not beater._task.done()
            await asyncio.sleep(0.02)
        assert beater.refused is None
        await beater.stop()


def test_a_client_refuses_a_token_that_cannot_be_sent():
    for bad, why in [("", "must not be empty"), ("two words", "visible ASCII"), ("caf\u00e9", "visible ASCII")]:
        with pytest.raises(ValueError, match=why) as err:
            RegistryClient("http://127.0.0.1:1", token=bad)
        assert bad not in str(err.value) or bad == ""


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_worker_flag_and_variable_reach_the_worker_settings(monkeypatch, role):
    import importlib

    from click.testing import CliRunner

    from pdserve.shared.worker.cli_options import given

    main = importlib.import_module(f"pdserve.services.{role}.main")
    built = []
    monkeypatch.setattr(main, "run_worker", lambda cls, worker_cls, flags: built.append(cls(**given(flags))))
    monkeypatch.delenv("PDSERVE_REGISTRY_TOKEN", raising=False)
    for args in (["--registry-token", "tok-flag"], []):
        result = CliRunner().invoke(main.command, args)
        assert result.exit_code == 0, result.output
        monkeypatch.setenv("PDSERVE_REGISTRY_TOKEN", "tok-env")
    assert [s.registry_token.get_secret_value() for s in built] == ["tok-flag", "tok-env"]
    assert "tok-env" not in repr(built[1])  # settings print masked


@pytest.mark.slow
def test_a_worker_process_with_a_wrong_token_exits_at_startup_instead_of_serving_unlisted(secured, redis_url,
                                                                                         tmp_path):
    """A configuration error must be loud: the worker process exits non-zero (Kubernetes crash-loops it) with
    the registry's refusal in its log, rather than staying up, healthy and never routed to."""
    log = tmp_path / "decode.log"
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_REGISTRY_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "decode", "--host", "127.0.0.1", "--port", str(free_port()),
         "--kv-port", "0", "--redis-url", redis_url, "--registry-url", secured.url, "--registry-token", "tok-9f3e1d5c",
         "--pod-id", "decode-wrong-token"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env={**env, "PDSERVE_LOG_LEVEL": "info"}, timeout=110)
    text = log.read_text(errors="replace")
    assert proc.returncode != 0, text
    assert "RegistryAuthError" in text and "not the registry's" in text, text[-2000:]
    assert "tok-9f3e1d5c" not in text  # the token is never logged
    assert registered(secured.url) == []
