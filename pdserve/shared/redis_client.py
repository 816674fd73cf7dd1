"""The one place a Redis client is built: every service and tool calls ``connect`` with its ``--redis-url``.

URL forms (docs/ensemble.md, "Redis"):
  ``redis://[:password@]host:port[/db]``, ``rediss://...`` (TLS), ``unix:///path/redis.sock[?db=0]``
      one Redis server (redis-py's ``from_url`` reads the query options).
  ``redis+cluster://[:password@]host:port[,host:port...]`` (``rediss+cluster://`` for TLS)
      a Redis Cluster: the listed nodes are seeds, the client learns the slot map from them and follows
      MOVED/ASK. Every key pdserve writes carries a hash tag (pdserve/shared/protocol/keys.py), so each
      multi-key command, Lua script and XREAD stays in one slot.
  ``redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db]`` (``rediss+sentinel://``)
      the primary that the Sentinels name for ``service_name``; after a failover the client asks them again
      and reconnects to the promoted replica. ``?sentinel_password=`` authenticates to the Sentinels.

``connect`` returns an asyncio client by default and a synchronous one with ``sync=True``. ``pool`` (the
most connections, and seconds to wait for a free one) makes a single-server client wait instead of failing when
its pool is full (``BlockingConnectionPool``); a cluster client opens at most that many per node. Connection
and timeout errors are retried ``retries`` times with exponential backoff from ``backoff_s`` up to
``backoff_cap_s``. A malformed URL raises ``ValueError`` naming the part that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.shared.protocol.keys import redact_url

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


@dataclass(slots=True)
class RedisTarget:
    """A parsed ``redis+cluster://`` or ``redis+sentinel://`` URL: ``kind`` is ``"cluster"`` or ``"sentinel"``."""

    kind: str
    nodes: list[tuple[str, int]]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    service_name: str | None = None
    db: int = 0
    options: dict[str, str] = field(default_factory=dict)


def parse_url(url: str) -> RedisTarget | None:
    """The cluster or sentinel target of ``url``; None for a URL redis-py reads itself (redis, rediss, unix)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        return None
    kind = "cluster" if scheme in CLUSTER_SCHEMES else "sentinel"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = auth.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    nodes = [_host_port(h, url) for h in hosts.split(",") if h]
    if not nodes:
        raise ValueError(f"redis_url: {redact_url(url)} names no host:port")
    parts = [p for p in path.split("/") if p]
    target = RedisTarget(kind, nodes, tls=scheme.startswith("rediss"), username=username, password=password,
                         options={k: v[-1] for k, v in parse_qs(query).items()})
    if kind == "sentinel":
        if not parts:
            raise ValueError(f"redis_url: {redact_url(url)} names no service: redis+sentinel://host:port/service_name")
        target.service_name, parts = parts[0], parts[1:]
    if parts:
        if kind == "cluster" or len(parts) > 1 or not parts[0].isdigit():
            raise ValueError(f"redis_url: unexpected path {'/'.join(parts)!r} in {redact_url(url)}")
        target.db = int(parts[0])
    return target


def _host_port(item: str, url: str) -> tuple[str, int]:
    host, colon, port = item.rpartition(":")
    if not colon:
        host, port = item, "26379" if "sentinel" in url.partition("://")[0] else "6379"
    if not port.isdigit():
        raise ValueError(f"redis_url: bad port in {item!r} of {redact_url(url)}")
    return host.strip("[]"), int(port)


def _retry_kwargs(sync: bool, retries: int, backoff_s: float, backoff_cap_s: float) -> dict[str, Any]:
    if sync:
        from redis.retry import Retry
    else:
        from redis.asyncio.retry import Retry
    return {"retry": Retry(ExponentialBackoff(cap=backoff_cap_s, base=backoff_s), retries),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError]}


def connect(url: str, *, sync: bool = False, pool: tuple[int, float] | None = None, retries: int = 0,
            backoff_s: float = 0.1, backoff_cap_s: float = 2.0, **kwargs: Any) -> Any:
    """A redis-py client for ``url`` (module doc). ``kwargs`` go to the connections (``socket_timeout``, ...)."""
    if retries:
        kwargs.update(_retry_kwargs(sync, retries, backoff_s, backoff_cap_s))
    target = parse_url(url)
    if target is None:
        return _single(url, sync, pool, kwargs)
    if target.username:
        kwargs["username"] = target.username
    if target.password:
        kwargs["password"] = target.password
    if target.tls:
        kwargs["ssl"] = True
    if target.kind == "cluster":
        return _cluster(target, sync, pool, kwargs)
    return _sentinel(target, sync, pool, kwargs)


def _single(url: str, sync: bool, pool: tuple[int, float] | None, kwargs: dict[str, Any]) -> Any:
    if sync:
        import redis as module
    else:
        import redis.asyncio as module  # type: ignore[no-redef]
    if pool is None:
        return module.Redis.from_url(url, **kwargs)
    max_connections, wait_s = pool
    blocking = module.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s, **kwargs)
    return module.Redis.from_pool(blocking)


def _cluster(target: RedisTarget, sync: bool, pool: tuple[int, float] | None, kwargs: dict[str, Any]) -> Any:
    if pool is not None:
        kwargs["max_connections"] = pool[0]
    if sync:
        from redis.cluster import ClusterNode, RedisCluster
    else:
        from redis.asyncio.cluster import ClusterNode, RedisCluster  # type: ignore[assignment]
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes], **kwargs)


def _sentinel(target: RedisTarget, sync: bool, pool: tuple[int, float] | None, kwargs: dict[str, Any]) -> Any:
    if sync:
        from redis.sentinel import Sentinel
    else:
        from redis.asyncio.sentinel import Sentinel  # type: ignore[assignment]
    if pool is not None:
        kwargs["max_connections"] = pool[0]
    sentinel_kwargs = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout", "ssl")}
    if "sentinel_password" in target.options:
        sentinel_kwargs["password"] = target.options["sentinel_password"]
    sentinels = Sentinel(target.nodes, sentinel_kwargs=sentinel_kwargs, **kwargs)
    return sentinels.master_for(target.service_name, db=target.db)


def is_cluster(client: Any) -> bool:
    """``client`` talks to a Redis Cluster (commands over several slots must be split per slot)."""
    from redis.asyncio.cluster import RedisCluster as AsyncCluster
    from redis.cluster import RedisCluster
    return isinstance(client, (AsyncCluster, RedisCluster))
