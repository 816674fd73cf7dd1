"""KV-aware choice of the decode pod: pure scoring, no I/O (the dispatcher feeds it the registry's answer).

Cost of sending a request to pod *i* (NVIDIA Dynamo's KV router, ``KvScheduler``: blocks still to prefill
plus weighted decode load; llm-d's prefix-cache + load scorers combine the same two signals):

    cost_i = (num_blocks - overlap_i) + load_weight * load_i

``num_blocks``: the prompt's full blocks; ``overlap_i``: how many leading ones pod *i* holds (registry
lookup); ``load_i``: requests on the pod — the larger of what its last heartbeat reported (running +
waiting) and what this router has in flight to it (heartbeats lag by up to a second). ``load_weight`` is
therefore in blocks per request.

The pod is drawn with probability ``softmax(-(cost - min cost) / temperature)``: a pod one block dearer
keeps ``exp(-1/T)`` of the best one's weight, so a single hot prefix held by two equally loaded pods is
spread over both instead of piling onto whichever sorts first; ``temperature == 0`` takes the cheapest,
ties broken uniformly at random.

With offloading tiers (docs/engine.md "KV offloading tiers") a pod may hold a leading block in its KV pool, its
CPU tier or its disk tier; ``overlap_i`` is then the weighted count over the leading blocks held anywhere,
``device + tier_weights["cpu"] * cpu + tier_weights["disk"] * disk`` (each block counted in its best medium), so
the scores order device > CPU > disk > none. The weights are the fraction of a block's prefill a load saves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

RoutingMode = Literal["kv", "round_robin", "least_loaded"]
ROUTING_MODES: tuple[str, ...] = ("kv", "round_robin", "least_loaded")


@dataclass(slots=True)
class Candidate:
    """A decode pod as the scorer sees it: ``overlap`` leading prompt blocks cached, ``load`` requests;
    ``tier_overlap``: the registry's per-medium counts (``PodOverlap.tier_overlap``), empty without tiers."""

    pod: Any
    overlap: int
    load: float
    tier_overlap: Mapping[str, int] | None = None

    def weighted_overlap(self, tier_weights: Mapping[str, float] | None) -> float:
        if not self.tier_overlap or tier_weights is None:
            return self.overlap
        return self.tier_overlap.get("device", 0) + sum(
            w * self.tier_overlap.get(medium, 0) for medium, w in tier_weights.items())


@dataclass(slots=True)
class Choice:
    index: int
    costs: list[float]
    probabilities: list[float]

    @property
    def cost(self) -> float:
        return self.costs[self.index]


def pod_load(pod: Any, in_flight: Mapping[str, int]) -> int:
    """Requests on ``pod``: its reported running + waiting, or this router's in-flight count if larger."""
    reported = int(getattr(pod, "num_running", 0)) + int(getattr(pod, "num_waiting", 0))
    return max(reported, int(in_flight.get(pod.pod_id, 0)))


def costs(num_blocks: int, candidates: Sequence[Candidate], load_weight: float,
          tier_weights: Mapping[str, float] | None = None) -> list[float]:
    """``(num_blocks - overlap) + load_weight * load`` per candidate (overlap clipped to the chain; weighted over
    the media with ``tier_weights``, ``{"cpu": w, "disk": w}``)."""
    return [(num_blocks - min(max(c.weighted_overlap(tier_weights), 0), num_blocks)) + load_weight * c.load
            for c in candidates]


def probabilities(cost: Sequence[float], temperature: float) -> list[float]:
    """Softmax of ``-cost / temperature`` (shifted by the minimum, so it never overflows)."""
    best = min(cost)
    if temperature <= 0:
        ties = [1.0 if c == best else 0.0 for c in cost]
        return [t / sum(ties) for t in ties]
    weights = [math.exp(-(c - best) / temperature) for c in cost]
    total = sum(weights)
    return [w / total for w in weights]


def choose(num_blocks: int, candidates: Sequence[Candidate], load_weight: float, temperature: float,
           rng: random.Random | None = None, tier_weights: Mapping[str, float] | None = None) -> Choice:
    """Draws a candidate by cost. Raises ``ValueError`` when there is none."""
    if not candidates:
        raise ValueError("no candidate pods")
    cost = costs(num_blocks, candidates, load_weight, tier_weights)
    probs = probabilities(cost, temperature)
    r = (rng or random).random()
    acc = 0.0
    index = len(probs) - 1
    for i, p in enumerate(probs):
        acc += p
        if r < acc:
            index = i
            break
    while probs[index] == 0.0:  # rounding at the top end must not pick an excluded pod
        index -= 1
    return Choice(index, cost, probs)


def uncached_tokens(prompt_len: int, overlap_blocks: int, block_size: int) -> int:
    """Prompt tokens the chosen pod would still have to prefill (at least one: the last token's logits)."""
    return max(1, prompt_len - overlap_blocks * block_size)


class RoundRobin:
    """Cycles over the pods in ``pod_id`` order (the benchmark's baseline)."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, pods: Sequence[Any]) -> Any:
        ordered = sorted(pods, key=lambda p: p.pod_id)
        pod = ordered[self._next % len(ordered)]
        self._next += 1
        return pod
