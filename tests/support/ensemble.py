"""``pdserve up`` as a subprocess for end-to-end tests: real Redis, registry, router and workers."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from support.redis_server import free_port


class Ensemble:
    """Starts ``pdserve up ARGS`` on a free port; ``router_url``, ``registry_url``, ``redis_url`` once ready.

    The registry requires a bearer token: ``registry_headers`` carries the one this ensemble chose.
    """

    def __init__(self, *args: str, log_dir: Path, timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        """``env``: extra ``PDSERVE_*`` variables for every process (``pdserve up`` passes its environment on)."""
        self.args = list(args)
        self.env = dict(env or {})
        self.log_dir = Path(log_dir)
        self.timeout_s = timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.router_url = self.registry_url = self.redis_url = ""
        self.registry_token = secrets.token_hex(16)
        self.registry_headers = {"Authorization": f"Bearer {self.registry_token}"}
        self.redis_password = secrets.token_hex(16)  # up's Redis requires one; chosen here to reach it

    def __enter__(self) -> Ensemble:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._out = open(self.log_dir / "up.out", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.services.cli", "up", "--port", str(self.port), "--log-dir",
             str(self.log_dir), *self.args],
            stdout=self._out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_REGISTRY_TOKEN": self.registry_token,
                 "PDSERVE_REDIS_PASSWORD": self.redis_password, **self.env},
        )
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            text = (self.log_dir / "up.out").read_text()
            if "Press Ctrl-C to stop." in text:
                self.router_url = f"http://127.0.0.1:{self.port}"
                self.registry_url = re.search(r"registry\s+(http://\S+)", text).group(1)
                external = self.env.get("PDSERVE_REDIS_URL")  # a cluster or sentinel URL the test started
                self.redis_url = external or re.search(r"redis\s+(redis://\S+)", text).group(1).replace(
                    "redis://", f"redis://:{self.redis_password}@", 1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited {self.proc.returncode}:\n{text}")
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"pdserve up not ready in {self.timeout_s} s:\n{(self.log_dir / 'up.out').read_text()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()

    def pods(self, role: str) -> list[dict]:
        return httpx.get(f"{self.registry_url}/v1/pods", params={"role": role}, headers=self.registry_headers,
                         timeout=5).json()["pods"]

    def stats(self, pod: dict) -> dict:
        return httpx.get(f"http://{pod['host']}:{pod['http_port']}/v1/stats", timeout=10).json()

    def find_child_pid(self, service: str, pod_id: str | None = None) -> int | None:
        """The pid of ``pdserve up``'s child running ``service`` (``pdserve.services.cli SERVICE``; with ``pod_id``,
        the one whose PDSERVE_POD_ID is that), or None while there is none (e.g. between a kill and the restart)."""
        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                argv = proc.cmdline()
                if argv[argv.index("pdserve.services.cli") + 1] != service:
                    continue
                if pod_id is None or proc.environ().get("PDSERVE_POD_ID") == pod_id:
                    return proc.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, IndexError):
                continue
        return None

    def child_pid(self, service: str, pod_id: str | None = None) -> int:
        """``find_child_pid``, failing the test when there is no such child."""
        pid = self.find_child_pid(service, pod_id)
        if pid is None:
            raise AssertionError(f"no {service} process" + (f" for {pod_id}" if pod_id else ""))
        return pid


def stream_completion(ensemble: Ensemble, body: dict, on_text=None, timeout_s: float = 300) -> tuple[str, str | None]:
    """Stream ``POST /v1/completions`` through the ensemble's router, read with the strict SSE rule
    (``pdserve/loadtest/sse.py``); returns the text and the last finish reason. ``on_text(text so far)`` runs after every
    chunk that carried text (a test kills a process mid-stream there). An error chunk fails the test."""
    from pdserve.loadtest.sse import read_chunks

    text, finish = "", None
    with httpx.Client(timeout=timeout_s) as http:
        with http.stream("POST", f"{ensemble.router_url}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            for data in read_chunks(resp.iter_lines()):
                assert "error" not in data, data
                for choice in data["choices"]:
                    text += choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
                if on_text is not None and text:
                    on_text(text)
    return text, finish
