"""``pdserve up`` as a real process tree (real redis-server, real registry); nothing survives it."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import redis
from support.redis_server import free_port

import click

from pdserve.loadtest.cluster import up_argv
from pdserve.services.up import Child, Ensemble, UpOptions, _Stop, parse_cpus, plan
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.registry import PodInfo

pytestmark = [pytest.mark.timeout(180)]

TOKEN = "up-test-token-8c2e41"


class Up:
    """``pdserve up ARGS`` (the command under test, not an ensemble to test against) with its stdout read line by
    line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        environ = {k: v for k, v in os.environ.items()
                   if k not in ("REDIS_URL", "PDSERVE_REDIS_URL", "PDSERVE_REGISTRY_TOKEN", "PDSERVE_REDIS_PASSWORD")}
        self.proc = subprocess.Popen(up_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**environ, **(env or {})})
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError("up exited before printing %r:\n%s" % (pattern, "\n".join(self.output)))
            self.output.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError("no %r within %s s:\n%s" % (pattern, timeout_s, "\n".join(self.output)))

    def finish(self, timeout_s: float = 60) -> str:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            while True:
                try:
                    line = self.lines.get_nowait()
                except queue.Empty:
                    break
                if line is not None:
                    self.output.append(line)
            raise AssertionError("up still running after %s s:\n%s" % (timeout_s, "\n".join(self.output))) from None
        while (line := self.lines.get(timeout=5)) is not None:
            self.output.append(line)
        return "\n".join(self.output)


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def role_of(p: psutil.Process) -> str:
    argv = p.cmdline()
    if "redis-server" in argv[0]:  # it rewrites its own title
        return "redis-server"
    return argv[argv.index("pdserve.services.cli") + 1]


def all_gone(procs: list[psutil.Process], timeout_s: float = 20) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return all(p.status() == psutil.STATUS_ZOMBIE for p in alive if p.is_running())


@pytest.mark.slow
def test_up_starts_redis_and_registry_and_sigterm_leaves_no_process(tmp_path):
    up = Up("--prefill", "0", "--decode", "0", "--no-router", "--log-dir", str(tmp_path / "logs"),
            env={"PDSERVE_REGISTRY_TOKEN": TOKEN})
    try:
        m = up.wait_for(r"^  registry +(http://\S+)  \((.*)\)$")
        registry = m.group(1)
        assert m.group(2) == "bearer token: $PDSERVE_REGISTRY_TOKEN"
        m = up.wait_for(r"^  redis +(redis://\S+)  \((.*)\)$")
        redis_url = m.group(1)
        assert m.group(2) == "password generated for this run; set PDSERVE_REDIS_PASSWORD to choose it"
        up.wait_for("Press Ctrl-C to stop")
        children = descendants(up.proc.pid)
        names = sorted(role_of(p) for p in children)
        assert names == ["redis-server", "registry"], [p.cmdline() for p in children]
        # up's Redis wants a password: generated, handed to every child in its URL, never printed or in argv
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(redis_url).ping()
        (registry_proc,) = [p for p in children if role_of(p) == "registry"]
        child_url = registry_proc.environ()["PDSERVE_REDIS_URL"]
        password = child_url.split("@")[0].rsplit(":", 1)[1]
        assert len(password) == 64 and child_url == redis_url.replace("redis://", f"redis://:{password}@")
        assert password not in "\n".join(up.output)
        assert not any(password in " ".join(p.cmdline()) for p in children)
        redis_url = child_url
        assert httpx.get(f"{registry}/health").json() == {"status": "ok"}
        info = PodInfo(pod_id="decode-0", role="decode", host="127.0.0.1", http_port=1, model="m")
        assert httpx.post(f"{registry}/v1/pods", json=info.model_dump(mode="json")).status_code == 401
        assert httpx.post(f"{registry}/v1/pods", json=info.model_dump(mode="json"),
                          headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        r = redis.Redis.from_url(redis_url)
        assert r.exists(keys.pod_key("decode-0")) == 1  # the registry really uses that Redis
        r.close()
        assert (tmp_path / "logs" / "registry.log").exists()
        registry_log = (tmp_path / "logs" / "registry.log").read_text()
        assert TOKEN not in registry_log and TOKEN not in "\n".join(up.output) and password not in registry_log

        # the registry dies: up starts it again (its state is in Redis) instead of stopping everything
        registry_proc.kill()
        up.wait_for(r"pdserve up: registry exited with status -9; restarting it in 1 s")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{registry}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        pods = httpx.get(f"{registry}/v1/pods", headers={"Authorization": f"Bearer {TOKEN}"}).json()["pods"]
        assert [p["pod_id"] for p in pods] == ["decode-0"]  # kept in Redis across the restart
        children = descendants(up.proc.pid)

        up.proc.send_signal(signal.SIGTERM)
        out = up.finish()
        assert up.proc.returncode == 0, out
        assert "pdserve up: SIGTERM: stopping" in out and out.endswith("pdserve up: all processes stopped")
        assert all_gone(children)
        assert not (tmp_path / "logs" / "redis-data").exists()
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


@pytest.mark.slow
def test_sigkilled_up_still_takes_its_children_down(tmp_path):
    up = Up("--prefill", "0", "--decode", "0", "--no-router", "--log-dir", str(tmp_path / "logs"))
    up.wait_for("Press Ctrl-C to stop")
    children = descendants(up.proc.pid)
    assert len(children) == 2
    up.proc.kill()  # no chance to clean up: the kernel's parent-death signal does it
    up.proc.wait()
    assert all_gone(children)


@pytest.mark.slow
def test_a_child_failing_at_startup_is_reported_with_its_log_and_everything_stops(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = Up("--prefill", "0", "--decode", "0", "--no-router", "--registry-port", str(port),
                "--log-dir", str(tmp_path / "logs"))
        out = up.finish(timeout_s=120)
    assert up.proc.returncode == 1, out
    assert re.search(r"pdserve up: startup failed: registry exited with status \d+ during startup\. "
                     r"Last lines of .*/logs/registry\.log:", out), out
    assert "address already in use" in out.lower()  # the tail of the registry's own log
    assert out.endswith("pdserve up: all processes stopped")
    logs = str(tmp_path / "logs")
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if any(logs in a for a in (p.info["cmdline"] or []))]
    assert leftovers == []


# A worker that binds its port, forks a helper (as a tensor-parallel rank is forked) that stops (SIGSTOP) while it
# holds the inherited socket, and exits 3 (as a pod whose rank died does).
STOPPED_HELPER = """
import os, signal, socket, sys
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
helper = os.fork()
if helper == 0:
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)
with open(sys.argv[2], "a") as f:
    f.write(f"{helper}\\n")
os._exit(3)
"""


def _stopped_or_gone(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


@pytest.mark.slow
def test_a_restart_is_not_blocked_by_a_stopped_helper_of_the_old_process(tmp_path):
    """Issue 24: a stopped tensor-parallel rank outlived its pod holding the pod's ports, and every restart failed
    with ``address already in use``: the restart kills what is left of the old process group first."""
    port, helpers = free_port(), tmp_path / "helpers"
    child = Child("decode-0", [sys.executable, "-c", STOPPED_HELPER, str(port), str(helpers)], dict(os.environ),
                  tmp_path / "log")
    ensemble = Ensemble([child], echo=lambda *a, **k: None)
    child.start()
    try:
        assert child.proc.wait(30) == 3
        (first,) = map(int, helpers.read_text().split())
        assert _stopped_or_gone(first) == psutil.STATUS_STOPPED
        ensemble._restart_later(child, 3)  # due in 1 s
        time.sleep(1.1)
        ensemble._restart_later(child, 3)  # starts it again
        assert child.proc.wait(30) == 3, child.tail()  # it bound the port again (1: address already in use)
        assert _stopped_or_gone(first) in ("gone", psutil.STATUS_ZOMBIE)
    finally:
        child.signal_group(signal.SIGKILL)
        for pid in map(int, helpers.read_text().split() if helpers.exists() else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_up_uses_the_redis_it_is_given(tmp_path, redis_server):
    up = Up("--prefill", "0", "--decode", "0", "--no-router", "--log-dir", str(tmp_path / "logs"), "--follow-logs",
            env={"REDIS_URL": redis_server.url})
    try:
        m = up.wait_for(r"^  registry +(http://\S+)  \((.*)\)$")
        registry = m.group(1)
        assert m.group(2) == "bearer token generated for this run; set PDSERVE_REGISTRY_TOKEN to choose it"
        assert up.wait_for(r"^  redis +(\S+)").group(1) == redis_server.url
        up.wait_for("Press Ctrl-C to stop")
        (child,) = descendants(up.proc.pid)
        assert role_of(child) == "registry"
        info = PodInfo(pod_id="p0", role="prefill", host="127.0.0.1", http_port=1, model="m")
        assert httpx.post(f"{registry}/v1/pods", json=info.model_dump(mode="json")).status_code == 401
        token = child.environ()["PDSERVE_REGISTRY_TOKEN"]  # generated by up, never printed
        assert len(token) == 64 and token not in "\n".join(up.output)
        httpx.post(f"{registry}/v1/pods", json=info.model_dump(mode="json"),
                   headers={"Authorization": f"Bearer {token}"}).raise_for_status()
        r = redis.Redis.from_url(redis_server.url)
        assert r.exists(keys.pod_key("p0")) == 1
        r.close()
        up.proc.send_signal(signal.SIGINT)
        out = up.finish()
        assert out.endswith("pdserve up: all processes stopped") and up.proc.returncode == 0
        # --follow-logs: the registry's own log lines, prefixed
        assert "[registry] " in out and "pdserve.registry [-]: registry: redis " + redis_server.url in out  # pdserve/shared/logs.py FORMAT
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


@pytest.mark.slow
def test_a_model_typo_is_one_line_and_starts_nothing(tmp_path):
    up = Up("--model", "smollm2-135m-instruc", "--log-dir", str(tmp_path / "logs"))
    out = up.finish()
    assert up.proc.returncode == 1
    assert out == ("Error: --model: model 'smollm2-135m-instruc' is neither a known name (smollm2-135m-instruct), "
                   "a local Hugging Face model directory, nor a .gguf file")
    assert not (tmp_path / "logs").exists()  # not even Redis was started


@pytest.mark.slow
def test_a_stop_request_ends_the_startup_wait_even_while_a_health_probe_hangs(tmp_path):
    """Ctrl-C while the start-up probe waits on a child that accepts but does not answer (a loading worker): the
    signal handler only records it (an exception raised from a handler is lost when it lands in a library's
    ``except Exception``), and the wait stops within one probe."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        child = Child("decode-0", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ),
                      tmp_path / "log", health_url=f"http://127.0.0.1:{silent.getsockname()[1]}/health")
        ensemble = Ensemble([child], echo=lambda *a, **k: None)
        child.start()
        try:
            signal.signal(signal.SIGALRM, lambda signum, frame: ensemble.request_stop(signal.SIGINT))
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            started = time.monotonic()
            with pytest.raises(_Stop, match="SIGINT"):
                ensemble._wait_ready([child], time.monotonic() + 60, 60)
            assert time.monotonic() - started < 5  # one 2 s probe at most
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            ensemble.stop(5)


@pytest.mark.slow
def test_one_ctrl_c_during_startup_stops_everything_cleanly(tmp_path):
    up = Up("--prefill", "0", "--decode", "1", "--no-router", "--log-dir", str(tmp_path / "logs"))
    try:
        up.wait_for(r"^  registry +ready")
        children = descendants(up.proc.pid)
        up.proc.send_signal(signal.SIGINT)  # while the decode worker loads the model
        out = up.finish(timeout_s=60)
        assert up.proc.returncode == 0, out
        assert "pdserve up: SIGINT: stopping" in out and out.endswith("pdserve up: all processes stopped")
        assert "startup failed" not in out and "Traceback" not in out
        assert all_gone(children)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


@pytest.mark.slow
def test_ctrl_c_while_a_worker_builds_its_engine_stops_everything_in_seconds(tmp_path):
    # A long grace period: a worker that waited for its engine before stopping would hold up's stop that long.
    up = Up("--prefill", "0", "--decode", "1", "--no-router", "--stop-timeout-s", "120", "--log-dir", str(tmp_path / "logs"))
    try:
        up.wait_for(r"^  registry +ready")
        deadline = time.monotonic() + 120
        while not (workers := [p for p in descendants(up.proc.pid) if role_of(p) == "decode"]):
            assert time.monotonic() < deadline, "no decode worker"
            time.sleep(0.1)
        health = f"http://127.0.0.1:{workers[0].environ()['PDSERVE_PORT']}/health"
        while True:  # its HTTP side answers 503 while the engine is being built
            assert time.monotonic() < deadline, "the decode worker never answered /health"
            try:
                status = httpx.get(health, timeout=2).json()["status"]
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert status == "starting"
        children = descendants(up.proc.pid)
        started = time.monotonic()
        up.proc.send_signal(signal.SIGINT)
        out = up.finish(timeout_s=150)
        stopped_s = time.monotonic() - started
        assert up.proc.returncode == 0, out
        assert "did not stop" not in out and "Traceback" not in out, out
        log = (tmp_path / "logs" / "decode-0.log").read_text()
        assert "SIGTERM while loading the model: exiting" in log and "engine ready" not in log, log
        assert stopped_s < 6, f"up took {stopped_s:.1f} s to stop:\n{out}"  # up notices within one probe (<= 2 s)
        assert all_gone(children, timeout_s=1)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


@pytest.mark.slow
def test_up_refuses_an_unreachable_redis():
    up = Up("--no-router", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    out = up.finish()
    assert up.proc.returncode == 1
    assert "Error: cannot reach Redis at redis://127.0.0.1:" in out


def test_plan_forwards_engine_flags_and_gives_every_worker_its_own_ports(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_REGISTRY_TOKEN", raising=False)
    opts = UpOptions(model="smollm2-135m-instruct", num_prefill=2, num_decode=2, redis_url="redis://r:6379/0",
                     engine={"PDSERVE_DTYPE": "bfloat16", "PDSERVE_BLOCK_SIZE": "32",
                             "PDSERVE_ENABLE_PREFIX_CACHING": "false"})
    children = plan(opts, tmp_path)
    assert [c.name for c in children] == ["registry", "decode-0", "decode-1", "prefill-0", "prefill-1", "router"]
    workers = children[1:5]
    for c in workers:
        assert c.argv[-1] == c.name.split("-")[0]
        assert (c.env["PDSERVE_DTYPE"], c.env["PDSERVE_BLOCK_SIZE"], c.env["PDSERVE_ENABLE_PREFIX_CACHING"]) == (
            "bfloat16", "32", "false")
        assert c.env["PDSERVE_REDIS_URL"] == "redis://r:6379/0" and c.env["PDSERVE_MODEL"] == "smollm2-135m-instruct"
        assert c.env["PDSERVE_POD_ID"] == c.name
    ports = [c.env["PDSERVE_PORT"] for c in workers] + [c.env["PDSERVE_KV_PORT"] for c in workers[:2]]
    assert len(set(ports)) == 6
    assert len({c.env["PDSERVE_KV_TRANSFER_SECRET"] for c in children}) == 1  # one shared secret
    (token,) = {c.env["PDSERVE_REGISTRY_TOKEN"] for c in children}  # one registry token, for all of them
    assert len(token) == 64 and token != plan(opts, tmp_path)[0].env["PDSERVE_REGISTRY_TOKEN"]  # one per run
    assert children[-1].env["PDSERVE_PORT"] == "8000"
    colocated = plan(UpOptions(num_prefill=1, num_decode=1, colocated=True, redis_url="redis://r"), tmp_path)
    assert [c.name for c in colocated] == ["registry", "decode-0", "router"]
    assert colocated[1].env["PDSERVE_COLOCATED"] == "true"
    monkeypatch.setenv("PDSERVE_REGISTRY_TOKEN", TOKEN)  # a token of the user's choice reaches every child
    assert {c.env["PDSERVE_REGISTRY_TOKEN"] for c in plan(opts, tmp_path)} == {TOKEN}


def test_kv_offloading_flags_reach_the_prefill_pods_engine_too(tmp_path, monkeypatch):
    """The prefill pod's own prefix cache uses the tiers (a long shared system prompt is computed once per pod, not
    once per eviction): `pdserve up --kv-offloading-*` reaches prefill and decode children alike, and each one's
    settings give its engine a CPU tier and a disk tier in a directory of its own."""
    from click.testing import CliRunner

    from pdserve.services.decode.settings import DecodeSettings
    from pdserve.services.prefill.settings import PrefillSettings
    from pdserve.services.up import command

    seen = {}
    monkeypatch.setattr("pdserve.services.up.run", lambda opts: seen.setdefault("opts", opts) and 0)
    result = CliRunner().invoke(command, ["--kv-offloading-size", "2", "--kv-offloading-disk-path", str(tmp_path),
                                          "--kv-offloading-disk-size", "3", "--kv-offloading-store-threshold", "2",
                                          "--redis-url", "redis://r:6379/0"])
    assert result.exit_code == 0, result.output
    children = {c.name: c for c in plan(seen["opts"], tmp_path / "logs")}
    for name, settings_class in (("prefill-0", PrefillSettings), ("decode-0", DecodeSettings)):
        for key, value in children[name].env.items():
            if key.startswith("PDSERVE_"):
                monkeypatch.setenv(key, value)
        config = settings_class().engine_config()
        assert (config.kv_offloading_size, config.kv_offloading_disk_size) == (2.0, 3.0)
        assert config.kv_offloading_store_threshold == 2
        assert config.kv_offloading_disk_path == os.path.join(str(tmp_path), name)


def test_workers_split_the_cores_into_torch_threads_and_pinned_tiers_get_their_own(tmp_path, monkeypatch):
    import pdserve.services.up as up

    monkeypatch.delenv("PDSERVE_NUM_THREADS", raising=False)
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def threads(**kw) -> dict[str, tuple[str | None, frozenset | None]]:
        return {c.name: (c.env.get("PDSERVE_NUM_THREADS"), c.cpus) for c in plan(UpOptions(redis_url="redis://r", **kw),
                                                                               tmp_path) if c.is_worker}

    assert threads() == {"decode-0": ("2", None), "prefill-0": ("2", None)}  # 4 cores, 2 engine workers
    assert threads(colocated=True) == {"decode-0": ("4", None)}
    assert threads(num_prefill=1, num_decode=2) == {"decode-0": ("1", None), "decode-1": ("1", None),
                                                    "prefill-0": ("1", None)}
    p, d = frozenset({0}), frozenset({1, 2, 3})
    assert threads(prefill_cpus=p, decode_cpus=d) == {"decode-0": ("3", d), "prefill-0": ("1", p)}
    assert threads(decode_threads=5) == {"decode-0": ("5", None), "prefill-0": ("2", None)}  # explicit wins
    assert threads(decode_tensor_parallel_size=2) == {"decode-0": (None, None), "prefill-0": ("2", None)}
    monkeypatch.setenv("PDSERVE_NUM_THREADS", "3")  # the caller's own variable reaches the workers unchanged
    assert threads() == {"decode-0": ("3", None), "prefill-0": ("3", None)}


@pytest.mark.slow
def test_a_pinned_child_runs_on_its_cores_only(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    child = Child("decode-0", [sys.executable, "-c", code], dict(os.environ), tmp_path / "c.log",
                  cpus=frozenset(cores[:1]))
    child.start()
    assert child.proc.wait(30) == 0
    assert child.log_path.read_text().strip() == str(cores[:1])
    assert parse_cpus(None, None, str(cores[0])) == frozenset(cores[:1])
    assert parse_cpus(None, None, f"{cores[0]}-{cores[-1]}") == frozenset(range(cores[0], cores[-1] + 1))
    with pytest.raises(click.BadParameter, match="expected a core list"):
        parse_cpus(None, None, "0-x")
    with pytest.raises(click.BadParameter, match=r"cores \[4096\] are not among"):
        parse_cpus(None, None, "4096")


@pytest.mark.slow
def test_up_with_the_router_prints_a_working_openai_base_url(tmp_path):
    port = free_port()
    up = Up("--prefill", "0", "--decode", "0", "--port", str(port), "--log-dir", str(tmp_path / "logs"))
    try:
        base = up.wait_for(r"^  router +\S+  \(OpenAI base URL: (http://\S+/v1)\)").group(1)
        up.wait_for("Press Ctrl-C to stop")
        children = descendants(up.proc.pid)
        assert sorted(role_of(p) for p in children) == ["redis-server", "registry", "router"]
        assert base == f"http://127.0.0.1:{port}/v1"
        models = httpx.get(f"{base}/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]
        # the router asks the registry with up's token: it learns that no decode pod is up (a registry that
        # refused it would be "unreachable" to the router)
        r = httpx.post(f"{base}/completions", json={"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2},
                       timeout=30)
        assert (r.status_code, r.json()["error"]["message"]) == (503, "No decode pod is available; retry later")
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish().endswith("pdserve up: all processes stopped") and up.proc.returncode == 0
        assert all_gone(children)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


def test_up_checks_the_speculative_config_before_starting_anything():
    from click.testing import CliRunner

    from pdserve.services.up import command

    result = CliRunner().invoke(command, ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert result.exit_code == 2
    assert "speculative_config.num_speculative_tokens must be an integer >= 1" in result.output


def test_up_refuses_an_unknown_kv_connector_before_starting_anything_naming_the_registered_ones():
    from click.testing import CliRunner

    from pdserve.services.up import command

    result = CliRunner().invoke(command, ["--kv-transfer-config", '{"kv_connector": "nixl"}'])
    assert result.exit_code == 2
    assert "unknown kv_connector 'nixl'; registered: loopback, shm, tcp" in result.output


def test_a_worker_refuses_an_unknown_kv_connector_at_its_settings():
    from pydantic import ValidationError

    from pdserve.services.decode.settings import DecodeSettings

    with pytest.raises(ValidationError, match="unknown kv_connector 'rdma'; registered: loopback, shm, tcp"):
        DecodeSettings(kv_transfer_config='{"kv_connector": "rdma"}')


@pytest.mark.slow
def test_stop_gives_the_router_its_own_drain_before_sigkill(tmp_path):
    """One drain setting: ``up`` used to SIGKILL the router at ``--stop-timeout-s`` (10 s) after giving it
    half of that to drain, where the router's own ``shutdown_grace_s`` (docs/ensemble.md "Stopping") is 30 s. A
    stand-in router that takes 2 s to drain after SIGTERM, under a 0.5 s stop timeout, must exit on its own."""
    drain = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(2), sys.exit(7)))\n"
             "time.sleep(60)\n")
    router = Child("router", [sys.executable, "-c", drain], dict(os.environ), tmp_path / "router.log")
    router.start()
    time.sleep(1)  # its handler is installed
    Ensemble([router], echo=lambda *a, **k: None, router_grace_s=2.0).stop(0.5)
    assert router.proc.returncode == 7  # drained and exited, not SIGKILLed (-9)
