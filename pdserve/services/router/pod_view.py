"""What the router knows of the pods: the registry's answers (cached for ``cache_s``, one call per role at a
time, retried on a blip) and the decode pods that prefill pods found unreachable for KV transfer (Redis marks)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.shared.protocol import keys
from pdserve.shared.registry_client import RegistryAuthError

from .errors import OpenAIError

logger = logging.getLogger(__name__)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a caller that left does not want it logged as "never retrieved"


async def _uncancelled(coro: Any) -> Any:
    """Await ``coro``; if the caller is cancelled (its client hung up), ``coro`` still runs to its end.

    A registry call cancelled while it waits for a pooled connection leaks that pool slot for good in httpcore
    1.0.9 (encode/httpcore#1093): an abort storm of 200 clients left the router's registry client with no
    free connection, and every later request got 503 "The pod registry is unreachable" (PoolTimeout) until
    the router restarted. A call is short (its client times out after 2 s), so letting it finish is cheap.
    """
    task = asyncio.ensure_future(coro)
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


class PodDirectory(Protocol):
    """What the router needs of the registry (``RegistryClient`` satisfies it)."""

    async def list_pods(self, role: str) -> Sequence[Any]: ...


class PodView:
    """The registry's pod lists as the router reads them. ``directory``: the registry (``list_pods``, and
    ``lookup`` for kv routing); ``redis``: where the unreachable marks live (None: no marks);
    ``retry_after_s``: the Retry-After of the 503s it raises."""

    def __init__(self, redis: Redis | None, directory: PodDirectory, cache_s: float, retry_after_s: int) -> None:
        self.redis = redis
        self.directory = directory
        self.cache_s = cache_s
        self.retry_after_s = retry_after_s
        self._cache: dict[str, tuple[float, list[Any]]] = {}
        self._asking: dict[str, asyncio.Future] = {}  # role -> the registry call in flight for it
        self._marks: tuple[float, dict[str, float]] = (-1e9, {})

    async def unreachable(self, fresh: bool = False) -> dict[str, float]:
        """Decode pods a prefill pod found unreachable for KV transfer (pod id -> unix time the mark ends), read
        from Redis at most every ``cache_s`` (``fresh``: now); Redis unreachable: none (placing the request then
        answers)."""
        now = time.monotonic()
        if self.redis is None or (not fresh and now - self._marks[0] < self.cache_s):
            return self._marks[1]
        try:
            raw = await self.redis.hgetall(keys.KV_UNREACHABLE)
        except (RedisError, OSError) as exc:
            logger.warning("reading the unreachable decode pods failed: %s", exc)
            raw = {}
        wall = time.time()
        marks = {}
        for pod_id, until in (raw or {}).items():
            pod_id = pod_id.decode() if isinstance(pod_id, bytes) else str(pod_id)
            try:
                if float(until) > wall:
                    marks[pod_id] = float(until)
            except ValueError:
                continue
        self._marks = (now, marks)
        return marks

    async def reachable(self, pods: Sequence[Any], pod_of: Any = lambda p: p) -> list[Any]:
        """``pods`` without those marked unreachable, unless that leaves none (the mark is a preference: a pod
        that recovered is found by trying it)."""
        marks = await self.unreachable()
        kept = [p for p in pods if pod_of(p).pod_id not in marks]
        return kept or list(pods)

    async def pods(self, role: str) -> list[Any]:
        """Alive pods of ``role`` (cached for ``cache_s``); 503 ``OpenAIError`` when the registry is unreachable."""
        now = time.monotonic()
        cached = self._cache.get(role)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        # One registry call per role at a time, shared by everyone who asks meanwhile: when the cache expires
        # under load (hundreds of stalled choices checking their pod), they would otherwise send one call each.
        task = self._asking.get(role)
        if task is None:
            task = asyncio.ensure_future(self._list_pods(role))
            self._asking[role] = task
            task.add_done_callback(lambda t: (self._asking.pop(role, None), _retrieve(t)))
        return await asyncio.shield(task)

    async def context_limit(self, default: int) -> int:
        """The context length requests must fit: ``default`` (the router's ``max_model_len``), or less when a decode
        pod's engine reports less (its KV cache is smaller than the model's context). The registry unreachable:
        ``default`` (placing the request then answers the 503)."""
        try:
            pods = await self.pods("decode")
        except OpenAIError:
            return default
        reported = (int(getattr(p, "max_model_len", 0) or 0) for p in pods)
        return min([default, *(n for n in reported if n > 0)])

    async def _list_pods(self, role: str) -> list[Any]:
        pods = list(await self.ask_registry(self.directory.list_pods, role))
        self._cache[role] = (time.monotonic(), pods)
        return pods

    async def ask_registry(self, call, *args):
        """A registry call, tried again twice after a short pause: a registry slowed down by a loaded
        machine or a Redis restart costs a little latency, not a 503."""
        for attempt, pause in enumerate((0.2, 0.5, None)):
            try:
                return await _uncancelled(call(*args))
            except RegistryAuthError as exc:  # configuration, not an outage: say so, do not retry
                logger.error("the registry refused this router: %s", exc)
                raise self.unavailable("The pod registry refused this router's token (PDSERVE_REGISTRY_TOKEN); "
                                       "see the router's log") from exc
            except Exception as exc:
                logger.warning("registry call failed (attempt %d: %s: %s)", attempt + 1, type(exc).__name__, exc)
                if pause is None:
                    raise self.unavailable("The pod registry is unreachable") from exc
                await asyncio.sleep(pause)

    def unavailable(self, message: str) -> OpenAIError:
        """A 503 with this router's Retry-After."""
        return OpenAIError(503, message, headers={"Retry-After": str(self.retry_after_s)})
