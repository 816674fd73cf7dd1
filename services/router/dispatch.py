"""Choosing the decode pod and the prefill path, and enqueueing a request's choices.

Decode pod, by ``routing_mode``:
  kv (default)   one registry lookup with the prompt's block hashes (computed exactly as the engine does);
                 the pod with the lowest cost = uncached prompt blocks + weight x load, near-ties drawn at
                 random (``kv_routing.py``);
  least_loaded   fewest requests (counting those this router has in flight to it that its last heartbeat
                 may not show yet), then most free KV blocks;
  round_robin    pods in turn (the benchmark's baseline).
Prefill: remote, through ``pdserve:prefill``, unless the decode pod is colocated, or what the decode pod would
still have to prefill (kv: the prompt past its cached prefix; otherwise the whole prompt) is at most
``local_prefill_threshold`` tokens — then the decode pod prefills it itself (its own stream). With no prefill
pod alive, only a short prompt (at most ``fallback_max_tokens`` to prefill) goes to the decode pod: a long one
in a decode pod's batch would stall every request decoding there, so it waits in the prefill queue for a prefill
pod (the relay's prefill watch fails it with 503 when none comes).
"""

from __future__ import annotations

import asyncio

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.shared.protocol.messages import PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.registry_client import RegistryAuthError
from pdserve.shared.streams import ensure_group

from .errors import OpenAIError
from .kv_routing import Candidate, RoundRobin, choose, pod_load, uncached_tokens

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
class RoutingConfig:
    """``mode``: kv | least_loaded | round_robin; ``load_weight``: blocks per request; ``temperature``: blocks."""

    mode: str = "kv"
    load_weight: float = 8.0
    temperature: float = 1.0


@dataclass(slots=True)
class DispatchConfig:
    """The dispatcher's settings (``from_settings`` reads them off ``RouterSettings``).

    ``model``: the model named in every request; ``cache_s``: how long a registry answer is reused (s);
    ``local_prefill_threshold`` / ``fallback_max_tokens``: tokens to prefill up to which a decode pod prefills
    itself (always / when no prefill pod is alive; the fallback is never below the threshold);
    ``retry_after_s``: the Retry-After of a 503; ``routing``: how the decode pod is chosen.
    """

    model: str = ""
    cache_s: float = 0.5
    local_prefill_threshold: int = 0
    fallback_max_tokens: int = 256
    retry_after_s: int = 1
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    @classmethod
    def from_settings(cls, settings: Any) -> DispatchConfig:
        return cls(model=settings.model, cache_s=settings.registry_cache_s,
                   local_prefill_threshold=settings.local_prefill_threshold,
                   fallback_max_tokens=settings.local_prefill_fallback_max_tokens,
                   retry_after_s=settings.retry_after_s,
                   routing=RoutingConfig(settings.routing_mode, settings.routing_load_weight,
                                         settings.routing_temperature))


@dataclass(slots=True)
class ChoiceSpec:
    """One choice to enqueue: its internal request id, index in the response and sampling parameters; a resumed
    choice (migration) also carries the tokens and characters of text its client already has."""

    request_id: str
    choice_index: int
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_text_len: int = 0


@dataclass(slots=True)
class Dispatched:
    """What ``Dispatcher.dispatch``/``send`` did: where the choices went, the messages queued and their entry ids."""

    placement: Placement
    stream: str
    requests: list[PrefillRequest]
    entries: list[str]


@dataclass(slots=True)
class Placement:
    pod: Any
    local_prefill: bool
    reason: str = ""
    num_blocks: int = 0  # the prompt's full blocks (kv mode)
    cached_blocks: int = 0  # how many of them the chosen pod holds (kv mode)
    costs: dict[str, float] = field(default_factory=dict)


class Dispatcher:
    """Places a prompt's choices on a decode pod (asking the registry, cached for ``config.cache_s``), builds
    their ``PrefillRequest``s and XADDs them (``dispatch``).

    ``router_id``: this router incarnation, named in every request (decode pods drop a gone router's requests);
    ``metrics``: ``observe_routing(mode, pod_id, num_blocks, cached_blocks)`` per placement, or None.
    """

    def __init__(self, redis: Redis | None, directory: PodDirectory, config: DispatchConfig | None = None,
                 metrics: Any = None, rng: random.Random | None = None, router_id: str | None = None) -> None:
        self.config = config = config or DispatchConfig()
        self.fallback_max_tokens = max(config.fallback_max_tokens, config.local_prefill_threshold)
        self.routing = config.routing
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.router_id = router_id
        self.round_robin = RoundRobin()
        self.block_size: int | None = None  # learnt from the registry's pods
        self.redis = redis
        self.directory = directory
        self.cache_s = config.cache_s
        self.local_prefill_threshold = config.local_prefill_threshold
        self.retry_after_s = config.retry_after_s
        self.in_flight: Counter[str] = Counter()
        self._cache: dict[str, tuple[float, list[Any]]] = {}
        self._asking: dict[str, asyncio.Future] = {}  # role -> the registry call in flight for it
        self._groups: set[str] = set()
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

    async def _reachable(self, pods: Sequence[Any], pod_of: Any = lambda p: p) -> list[Any]:
        """``pods`` without those marked unreachable, unless that leaves none (the mark is a preference: a pod
        that recovered is found by trying it)."""
        marks = await self.unreachable()
        kept = [p for p in pods if pod_of(p).pod_id not in marks]
        return kept or list(pods)

    async def pods(self, role: str) -> list[Any]:
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
        pods = list(await self._ask_registry(self.directory.list_pods, role))
        self._cache[role] = (time.monotonic(), pods)
        return pods

    async def _ask_registry(self, call, *args):
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
        return OpenAIError(503, message, headers={"Retry-After": str(self.retry_after_s)})

    async def place(self, prompt_len: int, prompt_token_ids: Sequence[int] | None = None,
                    cache_salt: str | None = None) -> Placement:
        """Decode pod and prefill path for one prompt; 503 (``OpenAIError``) when no decode pod is alive."""
        if self.routing.mode == "kv" and prompt_token_ids is not None and hasattr(self.directory, "lookup"):
            placement = await self._place_kv(prompt_token_ids, cache_salt)
        else:
            placement = await self._place_by_load(prompt_len)
        self._observe(placement)
        return placement

    async def _place_by_load(self, prompt_len: int) -> Placement:
        decode = await self._reachable(await self.pods("decode"))
        if not decode:
            raise self.unavailable("No decode pod is available; retry later")
        if self.routing.mode == "round_robin":
            pod = self.round_robin.pick(decode)
        else:
            pod = pick_decode_pod(decode, self.in_flight)
        if getattr(pod, "colocated", False):
            return Placement(pod, True, "colocated decode pod")
        if prompt_len <= self.local_prefill_threshold:
            return Placement(pod, True, f"prompt {prompt_len} <= threshold {self.local_prefill_threshold} tokens")
        if not await self.pods("prefill"):
            return self._no_prefill_pod(pod, prompt_len)
        return Placement(pod, False, f"prompt {prompt_len} tokens")

    def _no_prefill_pod(self, pod: Any, suffix: int, *extra: Any) -> Placement:
        if suffix <= self.fallback_max_tokens:
            return Placement(pod, True, "no prefill pod alive", *extra)
        return Placement(pod, False, f"no prefill pod alive; {suffix} tokens to prefill > "
                                     f"{self.fallback_max_tokens}: waiting in the prefill queue", *extra)

    async def _place_kv(self, ids: Sequence[int], cache_salt: str | None) -> Placement:
        if self.block_size is None:
            decode = await self.pods("decode")
            if not decode:
                raise self.unavailable("No decode pod is available; retry later")
            self.block_size = int(Counter(int(p.block_size) for p in decode).most_common(1)[0][0])
        block_size = self.block_size
        hashes = [h.hex() for h in compute_block_hashes(ids, block_size, cache_salt)]
        reply = await self._ask_registry(self.directory.lookup, hashes, "decode")
        if not reply.pods:
            raise self.unavailable("No decode pod is available; retry later")
        # a pod with another block size hashes other blocks: it holds none of this chain
        self.block_size = int(Counter(int(o.pod.block_size) for o in reply.pods).most_common(1)[0][0])
        listed = await self._reachable(reply.pods, lambda o: o.pod)
        candidates = [Candidate(o.pod, o.overlap if int(o.pod.block_size) == block_size else 0,
                                pod_load(o.pod, self.in_flight)) for o in listed]
        # Prefer pods whose last heartbeat shows room for this prompt's uncached blocks: on a full pod the request
        # waits for blocks to free up (the prefill pod holds it).
        room = [c for c in candidates if int(getattr(c.pod, "free_blocks", 0) or 0) > len(hashes) - c.overlap]
        if room:
            candidates = room
        choice = choose(len(hashes), candidates, self.routing.load_weight, self.routing.temperature, self.rng)
        best = candidates[choice.index]
        pod, overlap = best.pod, best.overlap
        costs = {c.pod.pod_id: round(cost, 2) for c, cost in zip(candidates, choice.costs)}
        suffix = uncached_tokens(len(ids), overlap, block_size)
        if getattr(pod, "colocated", False):
            local, reason = True, "colocated decode pod"
        elif reply.num_prefill_pods == 0:
            return self._no_prefill_pod(pod, suffix, len(hashes), overlap, costs)
        elif suffix <= self.local_prefill_threshold:
            local, reason = True, f"uncached suffix {suffix} <= threshold {self.local_prefill_threshold} tokens"
        else:
            local, reason = False, f"uncached suffix {suffix} tokens"
        return Placement(pod, local, reason, len(hashes), overlap, costs)

    def _observe(self, placement: Placement) -> None:
        decision = "local" if placement.local_prefill else "remote"
        logger.info("routing (%s): decode pod %s, %d/%d prompt blocks cached there, costs %s -> %s prefill (%s)",
                    self.routing.mode, placement.pod.pod_id, placement.cached_blocks, placement.num_blocks,
                    placement.costs or "-", decision, placement.reason)
        if self.metrics is not None:
            self.metrics.observe_routing(self.routing.mode, placement.pod.pod_id, placement.num_blocks,
                                         placement.cached_blocks)

    async def ensure_group(self, stream: str, group: str) -> None:
        """Create the consumer group at id 0 if it is missing, so entries queued before the first worker
        started are still delivered (a group a worker creates at ``$`` would skip them)."""
        if stream in self._groups:
            return
        await ensure_group(self.redis, stream, group)
        self._groups.add(stream)

    async def dispatch(self, prompt_token_ids: list[int], choices: Sequence[ChoiceSpec], *,
                       cache_salt: str | None = None, priority: int = 0,
                       arrival_time: float | None = None) -> Dispatched:
        """Place the choices of one prompt (all on one decode pod: they share its prefix blocks), build their
        ``PrefillRequest``s and enqueue them. 503 (``OpenAIError``) when no decode pod is alive; Redis errors
        propagate."""
        placement = await self.place(len(prompt_token_ids), prompt_token_ids, cache_salt)
        return await self.send(placement, prompt_token_ids, choices, cache_salt=cache_salt, priority=priority,
                               arrival_time=arrival_time)

    async def send(self, placement: Placement, prompt_token_ids: list[int], choices: Sequence[ChoiceSpec], *,
                   cache_salt: str | None = None, priority: int = 0,
                   arrival_time: float | None = None) -> Dispatched:
        """Build the choices' ``PrefillRequest``s for ``placement`` and enqueue them (``dispatch`` after its own
        placement; a migration places first, on the prompt and the tokens already sent, to vet the pod)."""
        pod = placement.pod
        arrival = time.time() if arrival_time is None else arrival_time
        requests = [PrefillRequest(
            request_id=c.request_id, model=self.config.model, prompt_token_ids=prompt_token_ids,
            sampling_params=c.sampling_params, decode_pod_id=pod.pod_id, decode_host=pod.host,
            decode_kv_port=int(pod.kv_port), arrival_time=arrival, deadline=None, cache_salt=cache_salt,
            priority=priority, choice_index=c.choice_index, output_token_ids=c.output_token_ids,
            output_text_len=c.output_text_len, router_id=self.router_id) for c in choices]
        stream, entries = await self.enqueue(placement, requests)
        return Dispatched(placement, stream, requests, entries)

    async def enqueue(self, placement: Placement, requests: list[PrefillRequest]) -> tuple[str, list[str]]:
        """XADD the requests to the placement's queue; returns the stream and the entry id of each request."""
        if placement.local_prefill:
            stream, group = keys.decode_stream(placement.pod.pod_id), keys.DECODE_GROUP
        else:
            stream, group = keys.PREFILL_STREAM, keys.PREFILL_GROUP
        await self.ensure_group(stream, group)
        async with self.redis.pipeline(transaction=False) as pipe:
            for req in requests:
                pipe.xadd(stream, req.encode())
            ids = await pipe.execute()
        self.in_flight[placement.pod.pod_id] += len(requests)
        return stream, [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    def finished(self, pod_id: str, count: int) -> None:
        self.in_flight[pod_id] -= count
        if self.in_flight[pod_id] <= 0:
            del self.in_flight[pod_id]
