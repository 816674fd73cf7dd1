"""Choosing the decode pod and the prefill path for one prompt (``Placer.place``).

Decode pod, by ``routing_mode``:
  kv (default)   one registry lookup with the prompt's block hashes (computed exactly as the engine does);
                 the pod with the lowest cost = uncached prompt blocks + weight x load, near-ties drawn at
                 random (``kv_routing.py``);
  least_loaded   fewest requests (counting those this router has in flight to it that its last heartbeat
                 may not show yet), then most free KV blocks;
  round_robin    pods in turn (the benchmark's baseline).
Prefill: local (the decode pod's own stream) or remote (``pdserve:{q-prefill}:queue``), decided by one ``PdPolicy``
(``pd_policy.py``, ``--pd-policy``) on what the decode pod would still have to prefill (kv: the prompt past its
cached prefix; otherwise the whole prompt), the pod's last load report and the prefill tier's (live pods and
the prompt tokens they hold). Both modes ask the same policy.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from pdserve.shared.protocol.block_hash import compute_block_hashes

from .kv_routing import Candidate, RoundRobin, choose, pod_load, uncached_tokens
from .errors import OpenAIError
from .pd_policy import PdPolicy, PolicyConfig, PrefillCase, PrefillTier, ThresholdPolicy
from .pod_view import PodView

logger = logging.getLogger(__name__)


class PodLike(Protocol):
    pod_id: str
    host: str
    kv_port: int
    free_blocks: int
    num_running: int
    num_waiting: int
    colocated: bool


def pick_decode_pod(pods: Sequence[PodLike], in_flight: Counter[str]) -> PodLike:
    """Least loaded pod; ``in_flight`` counts this router's unfinished requests per pod id."""
    def load(p: PodLike) -> tuple[int, int, str]:
        busy = max(int(p.num_running) + int(p.num_waiting), in_flight.get(p.pod_id, 0))
        return busy, -int(p.free_blocks), p.pod_id
    return min(pods, key=load)


@dataclass(slots=True)
class RoutingConfig:
    """``mode``: kv | least_loaded | round_robin; ``load_weight``: blocks per request; ``temperature``: blocks;
    ``cpu_weight``/``disk_weight``: what a block in a pod's CPU/disk tier is worth against one in its KV pool."""

    mode: str = "kv"
    load_weight: float = 8.0
    temperature: float = 1.0
    cpu_weight: float = 0.9
    disk_weight: float = 0.7


@dataclass(slots=True)
class Placement:
    pod: Any
    local_prefill: bool
    reason: str = ""  # the policy's detail (for the log)
    num_blocks: int = 0  # the prompt's full blocks (kv mode)
    cached_blocks: int = 0  # how many of them the chosen pod holds (kv mode)
    costs: dict[str, float] = field(default_factory=dict)
    why: str = ""  # the decision's reason label (``pd_policy.REASONS``)


class Placer:
    """Places one prompt: a decode pod by ``routing.mode`` and the prefill path (see the module's docstring).

    ``in_flight``: this router's unfinished requests per pod id (shared with the dispatcher, which counts them);
    ``metrics``: ``observe_routing(mode, pod_id, num_blocks, cached_blocks)`` per placement, or None;
    ``policy``: the local-or-remote prefill decision (default: ``ThresholdPolicy`` on the two thresholds)."""

    def __init__(self, view: PodView, routing: RoutingConfig, local_prefill_threshold: int, fallback_max_tokens: int,
                 in_flight: Counter[str], metrics: Any = None, rng: random.Random | None = None,
                 policy: PdPolicy | None = None) -> None:
        self.view = view
        self.routing = routing
        self.local_prefill_threshold = local_prefill_threshold
        self.fallback_max_tokens = max(fallback_max_tokens, local_prefill_threshold)
        self.policy = policy or ThresholdPolicy(PolicyConfig(local_prefill_threshold, self.fallback_max_tokens))
        self.in_flight = in_flight
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.round_robin = RoundRobin()
        self.block_size: int | None = None  # learnt from the registry's pods

    async def place(self, prompt_len: int, prompt_token_ids: Sequence[int] | None = None,
                    cache_salt: str | None = None) -> Placement:
        """Decode pod and prefill path for one prompt; 503 (``OpenAIError``) when no decode pod is alive."""
        if self.routing.mode == "kv" and prompt_token_ids is not None and hasattr(self.view.directory, "lookup"):
            placement = await self._place_kv(prompt_token_ids, cache_salt)
        else:
            placement = await self._place_by_load(prompt_len)
        self._observe(placement)
        return placement

    async def _place_by_load(self, prompt_len: int) -> Placement:
        decode = await self.view.reachable(await self.view.pods("decode"))
        if not decode:
            raise self.view.unavailable("No decode pod is available; retry later")
        if self.routing.mode == "round_robin":
            pod = self.round_robin.pick(decode)
        else:
            pod = pick_decode_pod(decode, self.in_flight)
        return await self._decide(pod, prompt_len)

    async def _decide(self, pod: Any, tokens: int, num_prefill_pods: int | None = None, *extra: Any) -> Placement:
        """The policy's decision for ``tokens`` to prefill on ``pod``; ``num_prefill_pods``: a fresher count than
        the cached prefill pod list (the kv lookup's)."""
        try:
            prefill = await self.view.pods("prefill")
        except OpenAIError:
            if num_prefill_pods is None:
                raise
            prefill = []  # the lookup just answered: its count stands, without the queue's tokens
        decision = self.policy.decide(PrefillCase(pod, tokens, PrefillTier.of(prefill, num_prefill_pods)))
        return Placement(pod, decision.local, decision.detail, *extra, why=decision.reason)

    async def _place_kv(self, ids: Sequence[int], cache_salt: str | None) -> Placement:
        if self.block_size is None:
            decode = await self.view.pods("decode")
            if not decode:
                raise self.view.unavailable("No decode pod is available; retry later")
            self.block_size = int(Counter(int(p.block_size) for p in decode).most_common(1)[0][0])
        block_size = self.block_size
        hashes = [h.hex() for h in compute_block_hashes(ids, block_size, cache_salt)]
        reply = await self.view.ask_registry(self.view.directory.lookup, hashes, "decode")
        if not reply.pods:
            raise self.view.unavailable("No decode pod is available; retry later")
        # a pod with another block size hashes other blocks: it holds none of this chain
        self.block_size = int(Counter(int(o.pod.block_size) for o in reply.pods).most_common(1)[0][0])
        listed = await self.view.reachable(reply.pods, lambda o: o.pod)
        candidates = [Candidate(o.pod, o.overlap, pod_load(o.pod, self.in_flight), o.tier_overlap)
                      if int(o.pod.block_size) == block_size else Candidate(o.pod, 0, pod_load(o.pod, self.in_flight))
                      for o in listed]
        # Prefer pods whose last heartbeat shows room for this prompt's uncached blocks: on a full pod the request
        # waits for blocks to free up (the prefill pod holds it).
        room = [c for c in candidates if int(getattr(c.pod, "free_blocks", 0) or 0) > len(hashes) - c.overlap]
        if room:
            candidates = room
        choice = choose(len(hashes), candidates, self.routing.load_weight, self.routing.temperature, self.rng,
                        {"cpu": self.routing.cpu_weight, "disk": self.routing.disk_weight})
        best = candidates[choice.index]
        pod, overlap = best.pod, best.overlap
        costs = {c.pod.pod_id: round(cost, 2) for c, cost in zip(candidates, choice.costs)}
        # what the pod would still compute: blocks in its CPU or disk tier load back (the scheduler's tier lookup),
        # so they count as cached here, as in the scorer; `overlap` (the pool's) stays the routing metric's hit
        held = sum(best.tier_overlap.values()) if best.tier_overlap else overlap
        suffix = uncached_tokens(len(ids), held, block_size)
        return await self._decide(pod, suffix, reply.num_prefill_pods, len(hashes), overlap, costs)

    def _observe(self, placement: Placement) -> None:
        decision = "local" if placement.local_prefill else "remote"
        logger.info("routing (%s): decode pod %s, %d/%d prompt blocks cached there, costs %s -> %s prefill (%s)",
                    self.routing.mode, placement.pod.pod_id, placement.cached_blocks, placement.num_blocks,
                    placement.costs or "-", decision, placement.reason)
        logger.debug("pd decision (%s policy): %s, reason %s: %s", self.policy.name, decision, placement.why,
                     placement.reason)
        if self.metrics is not None:
            self.metrics.observe_routing(self.routing.mode, placement.pod.pod_id, placement.num_blocks,
                                         placement.cached_blocks)
