"""One local ensemble for tests and benchmarks: ``Cluster("--prefill", "2", ...)`` takes ``pdserve up``'s flags.

Two ways to run it, one interface (URLs, the registry's pods, a child's stats, pid, log, kill, pause, resume):

- in process (the default): ``services.up.plan`` and ``up.Ensemble`` start the children from here, so a test can
  give one child its own settings (``child_env``), start another router beside them (``extra_router``) and reach
  each ``up.Child``;
- ``process=True``: ``pdserve up`` itself runs as a subprocess, for what its supervision does (a child that dies
  is started again) and for another checkout's code (``pythonpath``, e.g. main against a branch).

``up_argv`` is the one command line that starts ``pdserve up``.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import redis as redis_sync

from pdserve.services import up
from pdserve.shared import redis_client


def up_argv(*args: str, python: str | None = None) -> list[str]:
    """The command line of ``pdserve up ARGS`` run by this interpreter (or ``python``)."""
    return [python or sys.executable, "-m", "pdserve.services.cli", "up", *args]


def wait_for(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


class Cluster:
    """``pdserve up ARGS`` on a free port, logs in ``log_dir``; ready on entering, stopped on leaving.

    ``env``: extra ``PDSERVE_*`` settings for every child (``PDSERVE_CLAIM_IDLE_S``, ``PDSERVE_REDIS_URL`` for a
    Redis the caller started); ``child_env`` (in process only): more for one child by name
    (``{"decode-0": {"PDSERVE_KV_CACHE_MEMORY": "48MiB"}}``). ``process``: run ``pdserve up`` as a subprocess;
    ``pythonpath``: that subprocess imports pdserve from this checkout. ``serving_model``: also wait until one
    completion of that model succeeds (a foreign checkout's readiness).
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 child_env: dict[str, dict[str, str]] | None = None, log_dir: Path | None = None,
                 timeout_s: float = 600.0, process: bool = False, pythonpath: str | None = None,
                 serving_model: str | None = None) -> None:
        assert process or pythonpath is None, "another checkout runs as a subprocess (process=True)"
        assert not (process and child_env), "child_env needs the in-process cluster"
        assert process or serving_model is None, "the in-process cluster is ready when every child is healthy"
        self.args = list(args)
        self.env = dict(env or {})
        self.child_env = dict(child_env or {})
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-cluster-"))
        self.timeout_s = timeout_s
        self.process = process
        self.pythonpath = pythonpath
        self.serving_model = serving_model
        self.port = up.free_port()
        self.children: list[up.Child] = []  # in process
        self.ensemble: up.Ensemble | None = None
        self.proc: subprocess.Popen | None = None  # ``pdserve up`` (process=True)
        self.urls: dict[str, str] = {}  # child name -> base URL
        self.registry_token = ""
        self._redis_url = ""

    # ---- start and stop -------------------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_process() if self.process else self._start_children()
            if self.serving_model:
                from pdserve.loadtest.procs import wait_serving

                wait_serving(self.router_url, self.serving_model, self.proc, str(self.log_dir / "up.out"),
                             self.timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start_children(self) -> None:
        opts = up.parse([*self.args, "--port", str(self.port), "--log-dir", str(self.log_dir),
                         "--startup-timeout-s", str(self.timeout_s)])
        redis_url = self.env.get("PDSERVE_REDIS_URL")
        engine = {k: v for k, v in self.env.items() if k != "PDSERVE_REDIS_URL"}
        opts.redis_url, opts.engine = opts.redis_url or redis_url, {**opts.engine, **engine}
        self.children = up.plan(opts, self.log_dir)
        for child in self.children:
            child.env.update(self.child_env.get(child.name, {}))
            if child.health_url:
                self.urls[child.name] = child.health_url.removesuffix("/health")
        self.ensemble = up.Ensemble(self.children, echo=lambda *a, **k: None)
        self.ensemble.start(opts.startup_timeout_s)
        self.registry_token = self.child("registry").env["PDSERVE_REGISTRY_TOKEN"]
        self._redis_url = up.external_redis_url(opts) or self.child("redis").redis_url

    def _start_process(self) -> None:
        self.registry_token = secrets.token_hex(16)
        # up's Redis requires a password; chosen here (or by the caller) to reach it
        password = self.env.get("PDSERVE_REDIS_PASSWORD") or secrets.token_hex(16)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_REGISTRY_TOKEN": self.registry_token,
               "PDSERVE_REDIS_PASSWORD": password, **self.env}
        if self.pythonpath:
            env["PYTHONPATH"] = os.path.abspath(self.pythonpath)
        with open(self.log_dir / "up.out", "w") as out:
            self.proc = subprocess.Popen(up_argv("--port", str(self.port), "--log-dir", str(self.log_dir),
                                                 *self.args), stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout_s
        while "Press Ctrl-C to stop." not in (text := self.out):
            if self.proc.poll() is not None:
                raise up.StartupError(f"pdserve up exited {self.proc.returncode}:\n{text}")
            if time.monotonic() > deadline:
                raise up.StartupError(f"pdserve up not ready in {self.timeout_s} s:\n{text}")
            time.sleep(0.5)
        self.urls = {"router": self.router_url, "registry": re.search(r"registry\s+(http://\S+)", text).group(1),
                     **dict(re.findall(r"^\s+((?:prefill|decode)-\d+)\s+(http://\S+)", text, re.M))}
        self._redis_url = self.env.get("PDSERVE_REDIS_URL") or re.search(r"redis\s+(redis://\S+)", text).group(
            1).replace("redis://", f"redis://:{password}@", 1)

    def __exit__(self, *exc: object) -> None:
        if self.ensemble is not None:
            for child in self.children:
                child.signal_group(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.ensemble.stop(10)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def out(self) -> str:
        """What ``pdserve up`` printed (process=True)."""
        return (self.log_dir / "up.out").read_text(errors="replace")

    # ---- where things are ---------------------------------------------------------------------------------------

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def registry_url(self) -> str:
        return self.urls["registry"]

    @property
    def redis_url(self) -> str:
        return self._redis_url

    @property
    def registry_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.registry_token}"}

    def child(self, name: str) -> up.Child:
        """The in-process child of that name (``redis``, ``registry``, ``router``, ``prefill-0`` ...)."""
        assert not self.process, "pdserve up's children are its own (process=True)"
        return next(c for c in self.children if c.name == name)

    def names(self, role: str) -> list[str]:
        """The children of that role (``prefill``, ``decode``) still running."""
        names = [c.name for c in self.children] if not self.process else list(self.urls)
        return [n for n in names if n.startswith(role + "-") and self.pid(n) is not None]

    def pods(self, role: str) -> list[dict]:
        """The registry's pods of that role."""
        return httpx.get(f"{self.registry_url}/v1/pods", params={"role": role}, headers=self.registry_headers,
                         timeout=5).json()["pods"]

    def stats(self, pod: str | dict) -> dict[str, Any]:
        """``/v1/stats`` of a child (by name) or of a pod the registry listed."""
        base = self.urls[pod] if isinstance(pod, str) else f"http://{pod['host']}:{pod['http_port']}"
        return httpx.get(f"{base}/v1/stats", timeout=10).json()

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def redis(self) -> redis_sync.Redis:
        return redis_client.connect(self.redis_url, sync=True, socket_timeout=5)

    # ---- processes ------------------------------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        """The pid of a running child by name (each leads its own process group), or None while there is none."""
        if not self.process:
            child = next((c for c in self.children if c.name == name), None)
            return child.proc.pid if child is not None and child.exited() is None else None
        if name == "redis":
            return self._find(lambda argv, environ: "redis-server" in os.path.basename(argv[0]))
        service, _, _ = name.partition("-")
        return self.find_child_pid(service, name if service in ("prefill", "decode") else None)

    def find_child_pid(self, service: str, pod_id: str | None = None) -> int | None:
        """The pid of the child running ``pdserve.services.cli SERVICE`` (with ``pod_id``, the one whose
        PDSERVE_POD_ID is that), or None while there is none (e.g. between a kill and the restart)."""
        if not self.process:
            return next((c.proc.pid for c in self.children if c.exited() is None and c.proc is not None
                         and "pdserve.services.cli" in c.argv
                         and c.argv[c.argv.index("pdserve.services.cli") + 1] == service
                         and (pod_id is None or c.env.get("PDSERVE_POD_ID") == pod_id)), None)

        def match(argv: list[str], environ: Callable[[], dict]) -> bool:
            return argv[argv.index("pdserve.services.cli") + 1] == service and (
                pod_id is None or environ().get("PDSERVE_POD_ID") == pod_id)
        return self._find(match)

    def child_pid(self, service: str, pod_id: str | None = None) -> int:
        """``find_child_pid``, failing the test when there is no such child."""
        pid = self.find_child_pid(service, pod_id)
        if pid is None:
            raise AssertionError(f"no {service} process" + (f" for {pod_id}" if pod_id else ""))
        return pid

    def _find(self, match: Callable[[list[str], Callable[[], dict]], bool]) -> int | None:
        import psutil

        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if match(proc.cmdline(), proc.environ):
                    return proc.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, IndexError):
                continue
        return None

    def kill(self, name: str) -> None:
        """SIGKILL: no shutdown code runs (a node loss, an OOM kill)."""
        if not self.process:
            child = self.child(name)
            child.signal_group(signal.SIGKILL)
            child.proc.wait(30)
            return
        pid = self.pid(name)
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)

    def pause(self, *names: str) -> None:
        for name in names:
            self._signal(name, signal.SIGSTOP)

    def resume(self, *names: str) -> None:
        for name in names:
            self._signal(name, signal.SIGCONT)

    def _signal(self, name: str, sig: int) -> None:
        if not self.process:
            self.child(name).signal_group(sig)
        elif (pid := self.pid(name)) is not None:
            os.killpg(pid, sig)

    def extra_router(self, env: dict[str, str]) -> up.Child:
        """Start one more router on the same Redis and registry with other settings (``env``); ready on return.
        It is stopped with the cluster (in process only)."""
        base = self.child("router")
        port = up.free_port()
        child = up.Child(f"router-{port}", base.argv, {**base.env, "PDSERVE_PORT": str(port), **env},
                         self.log_dir / f"router-{port}.log", health_url=f"http://127.0.0.1:{port}/health")
        self.children.append(child)
        self.urls[child.name] = f"http://127.0.0.1:{port}"
        child.start()
        if not wait_for(child.ready, 120, 0.2):
            raise RuntimeError(f"extra router not ready:\n{child.tail()}")
        return child
