"""A local Redis Cluster from the real ``redis-server`` binary (the one ``pdserve up`` starts): ``shards``
primaries on loopback that own an even share of the 16384 slots. For the cluster benchmark and the tests.

    with RedisClusterServers(shards=3) as cluster:
        client = redis_client.connect(cluster.url)    # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from pdserve.services.up import free_port, redis_executable

SLOTS = 16384


def _wait(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError, redis.ResponseError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {timeout_s} s")
        time.sleep(0.05)


class _Procs:
    """redis-server processes in one temporary directory, each with its own data dir and log."""

    def __init__(self, prefix: str, aof_dir: str | Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.root = Path(aof_dir) if aof_dir is not None else Path(self._tmp.name)
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, port: int, *args: str, name: str = "") -> subprocess.Popen:
        data = self.root / f"{name or 'node'}-{port}"
        data.mkdir(parents=True, exist_ok=True)
        log = open(data / "log", "ab")
        proc = subprocess.Popen([redis_executable(), *args, "--port", str(port), "--bind", "127.0.0.1",
                                 "--dir", str(data), "--daemonize", "no", "--loglevel", "warning", "--save", ""],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.procs[port] = proc
        return proc

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self._tmp.cleanup()


def cluster_port() -> int:
    """A free port whose cluster bus port (``port + 10000``, Redis 6) is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


# What the cluster clients and this harness ask while they start, not the ensemble's traffic: CLUSTER SLOTS and
# COMMAND (redis-py's cluster client sends COMMAND to one node per connection it initialises), INFO.
SETUP_COMMANDS = ("cmdstat_cluster", "cmdstat_info", "cmdstat_command")


class RedisClusterServers:
    """A Redis Cluster of ``shards`` primaries (no replicas) on loopback: ``cluster-enabled`` nodes that meet
    each other (CLUSTER MEET) and own an even share of the slots (CLUSTER ADDSLOTS; the bundled server is 6.2)."""

    def __init__(self, shards: int = 3) -> None:
        self.ports = [cluster_port() for _ in range(shards)]
        self._procs = _Procs("pdserve-cluster-")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def start(self, timeout_s: float = 20.0) -> RedisClusterServers:
        for port in self.ports:
            self._procs.start(port, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                              "--cluster-node-timeout", "2000", "--appendonly", "no")
        for port in self.ports:
            _wait(lambda p=port: self.node(p).ping(), timeout_s, f"cluster node {port}")
        share = SLOTS // len(self.ports)
        for i, port in enumerate(self.ports):
            node = self.node(port)
            last = SLOTS - 1 if i == len(self.ports) - 1 else (i + 1) * share - 1
            node.execute_command("CLUSTER", "ADDSLOTS", *range(i * share, last + 1))
            if i:
                node.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
        _wait(self._converged, timeout_s, "cluster state ok on every node")
        return self

    def _converged(self) -> bool:
        for port in self.ports:
            info = self.node(port).execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or f"cluster_known_nodes:{len(self.ports)}" not in text:
                return False
        return True

    def commandstats(self) -> list[int]:
        """Commands each shard has executed (INFO commandstats, summed over commands), in ``ports`` order."""
        counts = []
        for port in self.ports:
            stats = self.node(port).info("commandstats")
            counts.append(sum(v["calls"] for k, v in stats.items()
                              if k.startswith("cmdstat_") and not k.startswith(SETUP_COMMANDS)))
        return counts

    def reset_stats(self) -> None:
        for port in self.ports:
            self.node(port).config_resetstat()

    def close(self) -> None:
        self._procs.close()

    def __enter__(self) -> RedisClusterServers:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
