"""Choosing the decode pod and the prefill path, and enqueueing a request's choices.

Decode pod: the least loaded one the registry reports alive (fewest requests, counting those this router
has in flight to it that its last heartbeat may not show yet; then most free KV blocks). Prefill: remote,
through ``pdserve:prefill``, unless no prefill pod is alive, the decode pod is colocated, or the prompt is at
most ``local_prefill_threshold`` tokens — then the decode pod prefills it itself (its own stream).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from redis.asyncio import Redis

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import PrefillRequest

from .errors import OpenAIError

logger = logging.getLogger(__name__)


class PodLike(Protocol):
    pod_id: str
    host: str
    kv_port: int
    free_blocks: int
    num_running: int
    num_waiting: int
    colocated: bool


class PodDirectory(Protocol):
    """What the router needs of the registry (``RegistryClient`` satisfies it)."""

    async def list_pods(self, role: str) -> Sequence[Any]: ...


def pick_decode_pod(pods: Sequence[PodLike], in_flight: Counter[str]) -> PodLike:
    """Least loaded pod; ``in_flight`` counts this router's unfinished requests per pod id."""
    def load(p: PodLike) -> tuple[int, int, str]:
        busy = max(int(p.num_running) + int(p.num_waiting), in_flight.get(p.pod_id, 0))
        return busy, -int(p.free_blocks), p.pod_id
    return min(pods, key=load)


@dataclass(slots=True)
class Placement:
    pod: Any
    local_prefill: bool


class Dispatcher:
    """Asks the registry (cached for ``cache_s``) and XADDs ``PrefillRequest``s."""

    def __init__(self, redis: Redis, directory: PodDirectory, cache_s: float = 0.5,
                 local_prefill_threshold: int = 0, retry_after_s: int = 1) -> None:
        self.redis = redis
        self.directory = directory
        self.cache_s = cache_s
        self.local_prefill_threshold = local_prefill_threshold
        self.retry_after_s = retry_after_s
        self.in_flight: Counter[str] = Counter()
        self._cache: dict[str, tuple[float, list[Any]]] = {}

    async def pods(self, role: str) -> list[Any]:
        now = time.monotonic()
        cached = self._cache.get(role)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        try:
            pods = list(await self.directory.list_pods(role))
        except Exception as exc:
            logger.warning("registry unavailable (%s: %s)", type(exc).__name__, exc)
            raise self.unavailable("The pod registry is unreachable") from exc
        self._cache[role] = (now, pods)
        return pods

    def unavailable(self, message: str) -> OpenAIError:
        return OpenAIError(503, message, headers={"Retry-After": str(self.retry_after_s)})

    async def place(self, prompt_len: int) -> Placement:
        decode = await self.pods("decode")
        if not decode:
            raise self.unavailable("No decode pod is available; retry later")
        pod = pick_decode_pod(decode, self.in_flight)
        local = bool(getattr(pod, "colocated", False)) or prompt_len <= self.local_prefill_threshold
        if not local:
            local = not await self.pods("prefill")
        return Placement(pod, local)

    async def enqueue(self, placement: Placement, requests: list[PrefillRequest]) -> None:
        stream = keys.decode_stream(placement.pod.pod_id) if placement.local_prefill else keys.PREFILL_STREAM
        async with self.redis.pipeline(transaction=False) as pipe:
            for req in requests:
                pipe.xadd(stream, req.encode())
            await pipe.execute()
        self.in_flight[placement.pod.pod_id] += len(requests)

    def finished(self, pod_id: str, count: int) -> None:
        self.in_flight[pod_id] -= count
        if self.in_flight[pod_id] <= 0:
            del self.in_flight[pod_id]
