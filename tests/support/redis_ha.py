"""Redis Cluster and Redis Sentinel from the real ``redis-server`` binary (the one ``pdserve up`` starts), for tests.

    with RedisClusterServers(shards=3) as cluster:     # 3 primaries, 16384 slots split evenly
        client = redis_client.connect(cluster.url)    # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...
    with SentinelGroup(aof_dir=tmp_path) as group:     # primary + replica + 3 sentinels (quorum 2)
        client = redis_client.connect(group.url)      # redis+sentinel://.../pdserve
        group.kill_primary()                          # SIGKILL: the sentinels promote the replica
"""

from __future__ import annotations

from pathlib import Path

import redis

from pdserve.loadtest.redis_cluster import RedisClusterServers, _Procs, _wait  # noqa: F401 (re-exported)
from support.redis_server import free_port

SERVICE = "pdserve"


class SentinelGroup:
    """A primary, one replica and three sentinels watching them as ``SERVICE`` (quorum 2, down after 1 s).
    With ``aof_dir`` the data nodes keep an append-only file (fsync always), so an acknowledged write survives."""

    def __init__(self, aof_dir: str | Path | None = None, down_after_ms: int = 1000) -> None:
        self.primary_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.down_after_ms = down_after_ms
        self._procs = _Procs("pdserve-sentinel-", aof_dir)
        self.aof = aof_dir is not None

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{SERVICE}"

    def start(self, timeout_s: float = 20.0) -> SentinelGroup:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        self._procs.start(self.primary_port, *persistence, name="data")
        self._procs.start(self.replica_port, *persistence, "--replicaof", "127.0.0.1", str(self.primary_port),
                          name="data")
        for port in self.sentinel_ports:
            conf = self._procs.root / f"sentinel-{port}.conf"
            conf.write_text(f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {SERVICE} 5000\n"
                            f"sentinel parallel-syncs {SERVICE} 1\n")
            self._procs.start(port, str(conf), "--sentinel", name="sentinel")
        _wait(lambda: redis.Redis(port=self.replica_port).info("replication")["master_link_status"] == "up",
              timeout_s, "replica in sync")
        _wait(lambda: all(redis.Redis(port=p).execute_command("SENTINEL", "REPLICAS", SERVICE)
                          for p in self.sentinel_ports), timeout_s, "sentinels see the replica")
        return self

    def primary(self) -> tuple[str, int]:
        """The primary the sentinels name now."""
        host, port = redis.Redis(port=self.sentinel_ports[0]).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return (host.decode() if isinstance(host, bytes) else host), int(port)

    def kill_primary(self) -> int:
        """SIGKILLs the current primary; returns its port."""
        port = self.primary()[1]
        self._procs.kill(port)
        return port

    def wait_failover(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Waits until the sentinels name a new primary that accepts writes; returns its port."""
        _wait(lambda: self.primary()[1] != old_port and
              redis.Redis(port=self.primary()[1]).info("replication")["role"] == "master", timeout_s, "failover")
        return self.primary()[1]

    def close(self) -> None:
        self._procs.close()

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
