"""Enqueueing a request's choices: placed on one decode pod (``placement.py``, over the registry's answers in
``pod_view.py``), built into ``PrefillRequest``s (``build_requests``) and XADDed to the prefill queue or the decode
pod's own stream (``Dispatcher.enqueue``), with this router's in-flight count per pod."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from redis.asyncio import Redis

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.streams import ensure_group

from .pd_policy import PolicyConfig, make_policy
from .placement import Placement, Placer, PodLike, RoutingConfig, pick_decode_pod
from .pod_view import PodDirectory, PodView

__all__ = ["ChoiceSpec", "DispatchConfig", "Dispatched", "Dispatcher", "Placement", "PodDirectory", "PodLike",
           "RoutingConfig", "build_requests", "pick_decode_pod"]


@dataclass(slots=True)
class DispatchConfig:
    """The dispatcher's settings (``from_settings`` reads them off ``RouterSettings``).

    ``model``: the model named in every request; ``cache_s``: how long a registry answer is reused (s);
    ``local_prefill_threshold`` / ``fallback_max_tokens``: tokens to prefill up to which a decode pod prefills
    itself (always / when no prefill pod is alive; the fallback is never below the threshold);
    ``retry_after_s``: the Retry-After of a 503; ``routing``: how the decode pod is chosen; ``pd_policy`` and
    ``policy``: the local-or-remote prefill decision by name (``pd_policy.POLICIES``) and its inputs.
    """

    model: str = ""
    cache_s: float = 0.5
    local_prefill_threshold: int = 0
    fallback_max_tokens: int = 256
    retry_after_s: int = 1
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    pd_policy: str = "queue-aware"
    policy: PolicyConfig | None = None  # None: the two thresholds above, default estimates

    @classmethod
    def from_settings(cls, settings: Any) -> DispatchConfig:
        return cls(model=settings.model, cache_s=settings.registry_cache_s,
                   local_prefill_threshold=settings.local_prefill_threshold,
                   fallback_max_tokens=settings.local_prefill_fallback_max_tokens,
                   retry_after_s=settings.retry_after_s,
                   routing=RoutingConfig(settings.routing_mode, settings.routing_load_weight,
                                         settings.routing_temperature, settings.routing_kv_cpu_weight,
                                         settings.routing_kv_disk_weight),
                   pd_policy=settings.pd_policy,
                   policy=PolicyConfig(settings.local_prefill_threshold, settings.local_prefill_fallback_max_tokens,
                                       settings.ttft_slo_ms, settings.tpot_slo_ms, settings.prefill_tokens_per_s,
                                       settings.max_num_batched_tokens))

    def policy_config(self) -> PolicyConfig:
        """``policy`` with the thresholds of this config (the fallback never below the threshold)."""
        base = self.policy or PolicyConfig()
        return PolicyConfig(self.local_prefill_threshold, max(self.fallback_max_tokens, self.local_prefill_threshold),
                            base.ttft_slo_ms, base.tpot_slo_ms, base.prefill_tokens_per_s, base.step_budget_tokens)


@dataclass(slots=True)
class ChoiceSpec:
    """One choice to enqueue: its internal request id, index in the response and sampling parameters; a resumed
    choice (migration) also carries the tokens and characters of text its client already has."""

    request_id: str
    choice_index: int
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_text_len: int = 0
    traceparent: str | None = None  # the request's root span (PrefillRequest.traceparent)


@dataclass(slots=True)
class Dispatched:
    """What ``Dispatcher.dispatch``/``send`` did: where the choices went, the messages queued and their entry ids."""

    placement: Placement
    stream: str
    requests: list[PrefillRequest]
    entries: list[str]


def build_requests(placement: Placement, prompt_token_ids: list[int], choices: Sequence[ChoiceSpec], *, model: str,
                   router_id: str | None, cache_salt: str | None = None, priority: int = 0,
                   arrival_time: float | None = None) -> list[PrefillRequest]:
    """One ``PrefillRequest`` per choice, addressed to the placement's decode pod (``arrival_time``: unix s, now
    by default)."""
    pod = placement.pod
    arrival = time.time() if arrival_time is None else arrival_time
    return [PrefillRequest(
        request_id=c.request_id, model=model, prompt_token_ids=prompt_token_ids,
        sampling_params=c.sampling_params, decode_pod_id=pod.pod_id, decode_host=pod.host,
        decode_kv_port=int(pod.kv_port), decode_kv_endpoint=dict(getattr(pod, "kv_endpoint", None) or {}),
        arrival_time=arrival, deadline=None, cache_salt=cache_salt,
        priority=priority, choice_index=c.choice_index, output_token_ids=c.output_token_ids,
        output_text_len=c.output_text_len, router_id=router_id, traceparent=c.traceparent) for c in choices]


class Dispatcher:
    """Places a prompt's choices on a decode pod (``Placer``, asking the registry through ``PodView``), builds
    their ``PrefillRequest``s and XADDs them (``dispatch``); counts this router's requests per pod until
    ``finished``.

    ``router_id``: this router incarnation, named in every request (decode pods drop a gone router's requests);
    ``metrics``: ``observe_routing(mode, pod_id, num_blocks, cached_blocks)`` per placement, or None.
    """

    def __init__(self, redis: Redis | None, directory: PodDirectory, config: DispatchConfig | None = None,
                 metrics: Any = None, rng: random.Random | None = None, router_id: str | None = None) -> None:
        self.config = config = config or DispatchConfig()
        self.redis = redis
        self.router_id = router_id
        self.in_flight: Counter[str] = Counter()
        self.view = PodView(redis, directory, config.cache_s, config.retry_after_s)
        self.placer = Placer(self.view, config.routing, config.local_prefill_threshold, config.fallback_max_tokens,
                             self.in_flight, metrics, rng, make_policy(config.pd_policy, config.policy_config()))
        self._groups: set[str] = set()

    @property
    def fallback_max_tokens(self) -> int:
        return self.placer.fallback_max_tokens

    # the pods (PodView)
    async def pods(self, role: str) -> list[Any]:
        """Alive pods of ``role`` from the registry (cached for ``config.cache_s``); 503 when it is unreachable."""
        return await self.view.pods(role)

    async def unreachable(self, fresh: bool = False) -> dict[str, float]:
        """Decode pods marked unreachable for KV transfer: ``PodView.unreachable``."""
        return await self.view.unreachable(fresh)

    async def context_limit(self, default: int) -> int:
        """The context length requests must fit: ``PodView.context_limit``."""
        return await self.view.context_limit(default)

    # placing, building, enqueueing
    async def place(self, prompt_len: int, prompt_token_ids: Sequence[int] | None = None,
                    cache_salt: str | None = None) -> Placement:
        """Decode pod and prefill path for one prompt; 503 (``OpenAIError``) when no decode pod is alive."""
        return await self.placer.place(prompt_len, prompt_token_ids, cache_salt)

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
        requests = build_requests(placement, prompt_token_ids, choices, model=self.config.model,
                                  router_id=self.router_id, cache_salt=cache_salt, priority=priority,
                                  arrival_time=arrival_time)
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
