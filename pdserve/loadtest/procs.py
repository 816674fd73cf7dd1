"""Servers the benchmarks start for themselves (the mock, ``pdserve up``): start, wait until ready, stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from collections.abc import Iterator

from pdserve.loadtest.errors import LoadTestError


# Variables of this process that must not reach a server of another project: PYTHONPATH points at pdserve's tree
# (in a foreign venv it could shadow that venv's own packages), PYTHONHOME and PYTHONSTARTUP change which Python runs.
FOREIGN_ENV_DROP = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")


def foreign_env() -> dict[str, str]:
    """The environment for a server that is not pdserve (``vllm serve``, SGLang): the user's own, less what pdserve
    put there. Drops ``FOREIGN_ENV_DROP`` and ``OMP_WAIT_POLICY`` when ``import pdserve`` set it (pdserve's thread
    policy, not the user's: a foreign server runs with its own defaults, as from the user's shell)."""
    import pdserve

    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV_DROP}
    for key in pdserve.ENV_SET_ON_IMPORT:
        env.pop(key, None)
    return env


def tree_cpu_seconds(root: int) -> dict[int, float]:
    """pid -> user + system CPU seconds (its own and its reaped children's) for ``root`` and every live descendant,
    read from /proc (psutil). Empty when ``root`` is gone. Diff two readings with :func:`cpu_delta`."""
    import psutil

    try:
        procs = [psutil.Process(root)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system + t.children_user + t.children_system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the tree spent between two :func:`tree_cpu_seconds` readings. A process born in between counts
    from zero; one that exited in between counts only if a process of the tree reaped it (its parent's children
    times), so a tree whose workers come and go under load reads low, never high."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def listening_pid(port: int) -> int | None:
    """The pid of the process listening on TCP ``port`` on this machine, or None (no listener, or not visible to this
    user): how a server that was started elsewhere is found for CPU accounting."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    pids = {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    return min(pids) if pids else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def wait_healthy(url: str, proc: subprocess.Popen, log_path: str, timeout_s: float) -> None:
    """Poll ``GET url`` until 200; :class:`LoadTestError` if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LoadTestError(f"{' '.join(proc.args[:4])} exited with {proc.returncode}: {_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise LoadTestError(f"{url} was not healthy after {timeout_s:g} s: {_tail(log_path)}")


def wait_serving(base_url: str, model: str, proc: subprocess.Popen, log_path: str, timeout_s: float) -> None:
    """Poll a one-token completion until it answers 200: a router can be healthy before any worker is.

    503 and connection errors mean "not yet"; any other status is an error worth reporting at once.
    """
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LoadTestError(f"{' '.join(proc.args[:4])} exited with {proc.returncode}: {_tail(log_path)}")
        req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"
            if exc.code != 503:
                raise LoadTestError(f"{base_url} is up but cannot serve {model!r}: {last}") from None
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(1.0)
    raise LoadTestError(f"{base_url} could not serve a request after {timeout_s:g} s ({last})")


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


@contextmanager
def running(cmd: list[str], health_url: str, timeout_s: float = 300.0, env: dict[str, str] | None = None,
            serving_model: str | None = None, foreign: bool = False) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` in its own process group until the block ends; its output goes to a temp log.

    Ready means ``GET health_url`` answers 200 and, with ``serving_model``, that one completion succeeds.
    ``env`` is added to this process's environment, or with ``foreign`` (a server that is not pdserve) to
    :func:`foreign_env`.
    """
    log = tempfile.NamedTemporaryFile(prefix="pdserve-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**(foreign_env() if foreign else os.environ), **(env or {})})
    try:
        start = time.monotonic()
        wait_healthy(health_url, proc, log.name, timeout_s)
        if serving_model:
            base = health_url.rsplit("/", 1)[0]
            wait_serving(base, serving_model, proc, log.name, max(timeout_s - (time.monotonic() - start), 1.0))
        yield proc
    finally:
        stop(proc)
        log.close()
        os.unlink(log.name)


def mock_cmd(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.loadtest.cli", "mock-server", "--port", str(port), *args]
