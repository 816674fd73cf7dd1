"""The KV-aware scorer (pure) and the router's dispatcher against a real registry (ASGI) on a real redis-server.

Oracles: the cost formula worked by hand; seeded draws for the spread of a hot prefix (no pod above 70% when
two are equally loaded); the block hashes the engine itself computes (``compute_block_hashes``) published as
a pod's events, which the dispatcher must find and route to.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
import pytest_asyncio

from pdserve.services.router.dispatch import DispatchConfig, Dispatcher, RoutingConfig
from pdserve.services.router.errors import OpenAIError
from pdserve.services.router.kv_routing import (Candidate, RoundRobin, choose, costs, pod_load, probabilities,
                                                uncached_tokens)
from pdserve.services.router.metrics import RouterMetrics
from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.shared.protocol.kv_events import KVEvent, KVEventBatch
from pdserve.shared.registry_client import RegistryClient

from support.registry_inprocess import BLOCK, pod, registry_client


@dataclass
class P:
    pod_id: str
    num_running: int = 0
    num_waiting: int = 0


def test_cost_is_uncached_blocks_plus_weighted_load():
    cands = [Candidate(P("a"), overlap=30, load=2), Candidate(P("b"), overlap=0, load=0),
             Candidate(P("c"), overlap=99, load=1)]
    assert costs(34, cands, 4.0) == [4 + 8, 34, 0 + 4]
    assert pod_load(P("a", 3, 2), {"a": 4}) == 5
    assert pod_load(P("a", 1, 0), {"a": 4}) == 4  # this router knows of more than the last heartbeat
    assert uncached_tokens(544, 32, 16) == 32 and uncached_tokens(512, 32, 16) == 1


def test_softmax_probabilities_and_zero_temperature():
    p = probabilities([2.0, 3.0], 1.0)
    assert p[0] == pytest.approx(1 / (1 + 2.718281828459045 ** -1))
    assert probabilities([5.0, 5.0, 6.0], 0.0) == [0.5, 0.5, 0.0]
    assert probabilities([0.0, 1e6], 1.0)[1] == 0.0  # no overflow far from the best


def test_the_pod_holding_the_prefix_is_chosen():
    rng = random.Random(0)
    cands = [Candidate(P("cold"), overlap=0, load=0), Candidate(P("warm"), overlap=32, load=0)]
    picks = Counter(cands[choose(34, cands, 4.0, 1.0, rng).index].pod.pod_id for _ in range(2000))
    assert picks == {"warm": 2000}
    # ...unless it is much busier: 32 blocks saved do not outweigh 10 more requests at 4 blocks each
    cands[1].load = 10
    assert cands[choose(34, cands, 4.0, 1.0, rng).index].pod.pod_id == "cold"


def test_zero_temperature_breaks_exact_ties_at_random():
    rng = random.Random(1)
    cands = [Candidate(P("a"), 5, 0), Candidate(P("b"), 5, 0), Candidate(P("c"), 0, 0)]
    picks = Counter(choose(8, cands, 1.0, 0.0, rng).index for _ in range(400))
    assert set(picks) == {0, 1} and min(picks.values()) > 150


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hot_prefix_on_two_equally_loaded_pods_is_spread(seed):
    rng = random.Random(seed)
    cands = [Candidate(P("a"), overlap=62, load=3), Candidate(P("b"), overlap=62, load=3)]
    picks = Counter(choose(64, cands, 4.0, 1.0, rng).index for _ in range(1000))
    assert max(picks.values()) <= 700


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hot_prefix_stream_spreads_as_load_builds(seed):
    """Many requests with one 62-block prefix, first cached on pod a only; each routed request adds load to its
    pod until it finishes 32 arrivals later (32 in flight), and leaves the prefix cached there. The default
    weight (8 blocks per request) lets the warm pod lead by about 62 / 8 requests, no more."""
    rng = random.Random(seed)
    pods = [P("a"), P("b")]
    holds = {"a": True, "b": False}
    live: list[tuple[int, str]] = []
    counts: Counter[str] = Counter()
    for t in range(400):
        live = [(end, pid) for end, pid in live if end > t]
        in_flight = Counter(pid for _, pid in live)
        cands = [Candidate(p, 62 if holds[p.pod_id] else 0, pod_load(p, in_flight)) for p in pods]
        pid = cands[choose(64, cands, 8.0, 1.0, rng).index].pod.pod_id
        counts[pid] += 1
        holds[pid] = True
        live.append((t + 32, pid))
    assert max(counts.values()) <= 0.7 * 400, counts


def test_round_robin_cycles_in_pod_order():
    rr = RoundRobin()
    pods = [P("d1"), P("d0")]
    assert [rr.pick(pods).pod_id for _ in range(4)] == ["d0", "d1", "d0", "d1"]


# --- the dispatcher with a real registry ---



@pytest_asyncio.fixture
async def registry(redis_url):
    async for client in registry_client(redis_url):
        yield client


async def store(client: RegistryClient, pod_id: str, token_ids: list[int], salt: str | None = None, seq: int = 1):
    hashes = [h.hex() for h in compute_block_hashes(token_ids, BLOCK, salt)]
    await client.publish_kv_events(KVEventBatch(pod_id=pod_id, epoch="e", events=[
        KVEvent(seq=seq, kind="stored", block_hashes=hashes)]))


PREFIX = list(range(1000, 1512))  # 32 blocks


@pytest.mark.asyncio
async def test_dispatcher_routes_to_the_pod_holding_the_prefix(registry):
    for pid in ("d0", "d1", "d2"):
        await registry.heartbeat(pod(pid))
    await registry.heartbeat(pod("p0", role="prefill"))
    await store(registry, "d1", PREFIX + list(range(7, 39)))
    metrics = RouterMetrics("m")
    d = Dispatcher(None, registry, DispatchConfig(local_prefill_threshold=40, routing=RoutingConfig("kv", 4.0, 1.0)),
                   metrics=metrics, rng=random.Random(0))
    ids = PREFIX + list(range(50, 82))  # same 512-token prefix, new 32-token suffix
    for _ in range(5):
        pl = await d.place(len(ids), ids)
        assert pl.pod.pod_id == "d1" and (pl.num_blocks, pl.cached_blocks) == (34, 32)
        assert pl.local_prefill  # 32 uncached tokens <= 40
    # a longer uncached suffix goes to the prefill tier
    ids2 = PREFIX + list(range(50, 150))
    pl = await d.place(len(ids2), ids2)
    assert pl.pod.pod_id == "d1" and not pl.local_prefill
    # another cache_salt shares nothing: the cheapest is any pod with the whole prompt to prefill
    pl = await d.place(len(ids), ids, "tenant-b")
    assert pl.cached_blocks == 0 and not pl.local_prefill
    text = metrics.registry.get_sample_value
    assert text("pdserve:routing_cached_blocks_total", {"model_name": "m"}) == 32 * 6
    assert text("pdserve:routing_decisions_total", {"model_name": "m", "mode": "kv", "pod": "d1"}) >= 6


@pytest.mark.asyncio
async def test_dispatcher_prefills_locally_without_a_prefill_pod_and_round_robins(registry):
    await registry.heartbeat(pod("d0"))
    await registry.heartbeat(pod("d1"))
    d = Dispatcher(None, registry, DispatchConfig(fallback_max_tokens=64, routing=RoutingConfig("kv")))
    pl = await d.place(64, PREFIX[:64])
    assert pl.local_prefill and pl.reason == "no prefill pod alive"
    # a long prompt never falls back to a decode pod's batch: it waits in the prefill queue
    for mode in ("kv", "least_loaded"):
        d = Dispatcher(None, registry, DispatchConfig(fallback_max_tokens=64, routing=RoutingConfig(mode)))
        pl = await d.place(len(PREFIX), PREFIX)
        assert not pl.local_prefill, (mode, pl.reason)
        assert pl.reason == f"no prefill pod alive; {len(PREFIX)} tokens to prefill > 64: waiting in the prefill queue"
    await registry.heartbeat(pod("p0", role="prefill"))
    d = Dispatcher(None, registry, DispatchConfig(routing=RoutingConfig("round_robin")))
    assert [(await d.place(len(PREFIX), PREFIX)).pod.pod_id for _ in range(4)] == ["d0", "d1", "d0", "d1"]


@pytest.mark.asyncio
async def test_dispatcher_without_decode_pods_answers_503(registry):
    d = Dispatcher(None, registry)
    with pytest.raises(OpenAIError) as e:
        await d.place(len(PREFIX), PREFIX)
    assert e.value.status == 503


def test_a_prefix_in_the_pool_beats_one_in_cpu_beats_one_on_disk_beats_none():
    weights = {"cpu": 0.9, "disk": 0.7}
    media = ["device", "cpu", "disk"]
    pods = [Candidate(m, 4 if m == "device" else 0, 0, {**dict.fromkeys(media, 0), m: 4}) for m in media]
    pods.append(Candidate("none", 0, 0, dict.fromkeys(media, 0)))
    assert costs(6, pods, 8.0, weights) == pytest.approx([2.0, 6 - 3.6, 6 - 2.8, 6.0])
    assert choose(6, list(reversed(pods)), 8.0, 0.0, tier_weights=weights).index == 3  # the device pod
    # without tier counts (an older registry) or without weights, the pool's overlap alone counts, as before
    assert costs(6, [Candidate("old", 4, 0)], 8.0, weights) == costs(6, pods[:1], 8.0) == [2.0]
