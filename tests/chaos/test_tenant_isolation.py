"""``cache_salt`` isolation on the decode pod, for every way a prompt's blocks reach it: local prefill (the
router's ``--local-prefill-threshold``, no prefill tier alive, ``--colocated``), KV transfer from a prefill pod
(the decode pod's Reserve reply and the registry lookup the KV-aware router routes by), and migration off a
dead decode pod.

Real processes: the children ``pdserve up`` starts (redis-server, registry, router, one prefill and one decode
worker, the real model; a second ensemble with ``--colocated``), a second router on the same Redis and registry
that always prefills on the decode pod, a ``KVTransferClient`` that asks the decode pod for a reservation as a
prefill pod does, and the router's own ``Migrator``/``Dispatcher`` classes driven against that Redis and
registry (the decode pod that "died" is one the registry never knew; ``test_pod_failures.py`` SIGKILLs one).

Oracles: exact block arithmetic. A prompt of ``PROMPT_TOKENS`` = 72 tokens has ``FULL_BLOCKS`` = 4 full
16-token blocks (and a 5th, partial one). The engine recomputes at least the last prompt token, so a repeat
by the same tenant hits exactly the 4 full blocks (64 tokens; ``(72 - 1) // 16`` = 4) and a remote prefill of
it moves exactly 1 block (the partial one); another tenant, or no salt, hits 0 and moves all 5. Counters:
the decode pod's ``/v1/stats`` (``prefix_cache_hits`` in tokens, ``kv_blocks_received``), the prefill pod's
``pdserve:kv_transfer_blocks_skipped_total``, the router's ``pdserve:routing_cached_blocks_total`` (the
blocks its registry lookup said the chosen pod holds) and ``pdserve:pd_decisions_total``. The router does not
report ``usage.prompt_tokens_details.cached_tokens``, so the pods' counters are the oracle.
"""

from __future__ import annotations

import asyncio
import re
import time
import types
import uuid

import httpx
import pytest
import redis.asyncio as aioredis

from pdserve.loadtest import faultkit
from pdserve.services.router.dispatch import DispatchConfig, Dispatcher, RoutingConfig
from pdserve.services.router.migration import Migrator
from pdserve.services.router.relay import ChoiceRoute
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.registry_client import RegistryClient
from pdserve.shared.transport.client import KVTransferClient
from pdserve.shared.transport.frames import Reserve
from pdserve.shared.transport.layout import KVLayout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 16
PROMPT_TOKENS = 72
FULL_BLOCKS = PROMPT_TOKENS // BLOCK  # 4: all of them hit on a repeat, since (72 - 1) // 16 == 4 too
ALL_BLOCKS = -(-PROMPT_TOKENS // BLOCK)  # 5: what a cold remote prefill moves
ENV = {
    "PDSERVE_DTYPE": "bfloat16",
    "PDSERVE_KV_CACHE_MEMORY": "128MiB",
    "PDSERVE_POD_TTL_S": "5",
}
A, B = "tenant-a-3f9c", "tenant-b-77d1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with faultkit.Cluster("--prefill", "1", "--decode", "1",
                          env=ENV, log_dir=tmp_path_factory.mktemp("isolation")) as c:
        yield c


@pytest.fixture(scope="module")
def local_router(cluster):
    """A second router whose every request the decode pod prefills itself (any uncached suffix is under the
    threshold)."""
    return cluster.extra_router({"PDSERVE_LOCAL_PREFILL_THRESHOLD": "100000"})


def url_of(child) -> str:
    return child.health_url.removesuffix("/health")


def routing_reasons(cluster, router: str) -> list[str]:
    """The reasons the router's dispatcher logged for its local/remote decisions (``dispatch.py``)."""
    return re.findall(r"-> (?:local|remote) prefill \((.*)\)$", cluster.log(router), re.M)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """``prompts(i)``: the i-th 72-token prompt; no two share their first block, so no two share any block
    (block hashes chain), and each test starts cold on its own prompt."""
    first_blocks: dict[tuple[int, ...], int] = {}

    def make(i: int) -> list[int]:
        ids = tokenizer.encode(faultkit.prompts(1, words=90, seed=100 + i)[0])[:PROMPT_TOKENS]
        assert len(ids) == PROMPT_TOKENS
        assert first_blocks.setdefault(tuple(ids[:BLOCK]), i) == i
        return ids
    return make


# ---- observing the ensemble ------------------------------------------------------------------------------------


def registry_token(cluster) -> str:
    """The bearer token ``pdserve up``'s plan gave the registry (and every other child)."""
    return cluster.child("registry").env["PDSERVE_REGISTRY_TOKEN"]


def registry_headers(cluster) -> dict[str, str]:
    return {"Authorization": f"Bearer {registry_token(cluster)}"}


def decode_pod(cluster) -> dict:
    (pod,) = httpx.get(f"{cluster.registry_url}/v1/pods", params={"role": "decode"}, headers=registry_headers(cluster),
                       timeout=5).json()["pods"]
    return pod


def decode_stats(cluster) -> dict:
    return cluster.stats(cluster.names("decode")[0])


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter's samples at ``url``/metrics whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def prefill_url(cluster) -> str:
    return cluster.child(cluster.names("prefill")[0]).health_url.removesuffix("/health")


def overlaps(cluster, ids: list[int], salt: str | None) -> dict[str, int]:
    """The registry's answer to the lookup the router makes for ``ids`` under ``salt``: pod id -> leading
    blocks held."""
    hashes = [h.hex() for h in compute_block_hashes(ids, BLOCK, salt)]
    reply = httpx.post(f"{cluster.registry_url}/v1/kv/lookup", json={"block_hashes": hashes, "role": "decode"},
                       headers=registry_headers(cluster), timeout=5).json()
    return {o["pod"]["pod_id"]: o["overlap"] for o in reply["pods"]}


def wait_registry_holds(cluster, ids: list[int], salt: str | None, blocks: int) -> None:
    """Until the decode pod's block events for ``ids`` under ``salt`` reached the registry (they lag a step or a
    heartbeat): a lookup that answers 0 for another tenant only means something once it answers ``blocks`` for
    the owner."""
    pod = decode_pod(cluster)["pod_id"]
    ok = faultkit.wait_for(lambda: overlaps(cluster, ids, salt).get(pod, 0) >= blocks, 20, 0.2)
    assert ok, f"registry never showed {blocks} blocks of {salt}'s prompt on {pod}: {overlaps(cluster, ids, salt)}"


def ask(url: str, ids: list[int], salt: str | None) -> None:
    extra = {"cache_salt": salt} if salt is not None else {}

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            return await faultkit.completion(client, url, ids, 2, stream=False, ignore_eos=True, **extra)

    out = asyncio.run(run())
    assert out.kind == "completed" and out.completion_tokens == 2, out


class Counters:
    """Deltas of the counters the oracles read, across one request."""

    def __init__(self, cluster, router_url: str) -> None:
        self.cluster, self.router_url = cluster, router_url
        self.last = self.read()

    def read(self) -> dict[str, float]:
        s = decode_stats(self.cluster)
        out = {"hits": s["prefix_cache_hits"], "received": s["kv_blocks_received"],
               "router_cached": metric(self.router_url, "pdserve:routing_cached_blocks_total"),
               "local": metric(self.router_url, "pdserve:pd_decisions_total", decision="local"),
               "remote": metric(self.router_url, "pdserve:pd_decisions_total", decision="remote")}
        if self.cluster.names("prefill"):
            out["skipped"] = metric(prefill_url(self.cluster), "pdserve:kv_transfer_blocks_skipped_total")
        return out

    def zero(self) -> dict[str, float]:
        return {k: 0 for k in self.last}

    def delta(self) -> dict[str, float]:
        now = self.read()
        d = {k: now[k] - self.last[k] for k in now if k in self.last}
        self.last = now
        return d


# ---- (a) local prefill on the decode pod ------------------------------------------------------------------------


def local_prefill_round(cluster, router_url: str, ids: list[int]) -> int:
    """No salt, A, B, A, B through ``router_url``, whose every request the decode pod must prefill itself;
    returns how many requests it sent."""
    pod = decode_pod(cluster)["pod_id"]
    c = Counters(cluster, router_url)
    ask(router_url, ids, None)
    assert c.delta() == {**c.zero(), "local": 1}  # cold: no hit, nothing moved
    wait_registry_holds(cluster, ids, None, FULL_BLOCKS)
    assert overlaps(cluster, ids, A) == {pod: 0}  # a salted lookup finds none of the unsalted blocks
    ask(router_url, ids, A)
    assert c.delta() == {**c.zero(), "local": 1}  # 0 hits on the pod, and the router expected none
    wait_registry_holds(cluster, ids, A, FULL_BLOCKS)
    assert overlaps(cluster, ids, B) == {pod: 0}  # another tenant's lookup finds none of tenant A's blocks
    ask(router_url, ids, B)
    assert c.delta() == {**c.zero(), "local": 1}
    ask(router_url, ids, A)
    assert c.delta() == {**c.zero(), "hits": FULL_BLOCKS * BLOCK, "router_cached": FULL_BLOCKS, "local": 1}
    wait_registry_holds(cluster, ids, B, FULL_BLOCKS)
    ask(router_url, ids, B)  # B's own cache works: its 0 above was isolation, not a cache that never hits
    assert c.delta() == {**c.zero(), "hits": FULL_BLOCKS * BLOCK, "router_cached": FULL_BLOCKS, "local": 1}
    return 5


def test_local_prefill_on_the_decode_pod_hits_only_its_own_tenants_blocks(cluster, local_router, prompts):
    sent = local_prefill_round(cluster, url_of(local_router), prompts(0))
    reasons = routing_reasons(cluster, local_router.name)
    assert len(reasons) == sent and all(r.endswith("<= threshold 100000 tokens") for r in reasons), reasons


# ---- (b) KV transfer from a prefill pod -------------------------------------------------------------------------


async def reserve_probe(cluster, ids: list[int], salt: str | None) -> int:
    """The decode pod's Reserve reply ``num_cached_blocks`` for ``ids`` under ``salt``, asked over its KV-transfer
    port exactly as a prefill pod asks; the reservation is given back at once."""
    from transformers import AutoConfig

    from pdserve.shared.models.resolve import resolve_model

    pod = decode_pod(cluster)
    cfg = AutoConfig.from_pretrained(resolve_model(pod["model"]))
    layout = KVLayout(pod["block_size"], ENV["PDSERVE_DTYPE"], cfg.num_hidden_layers, cfg.num_key_value_heads,
                      cfg.hidden_size // cfg.num_attention_heads, pod["model"])
    secret = cluster.child(cluster.names("decode")[0]).env["PDSERVE_KV_TRANSFER_SECRET"]
    rid = f"probe-{uuid.uuid4().hex[:8]}"
    async with KVTransferClient(pod["host"], pod["kv_port"], layout, secret) as client:
        reply = await client.reserve(Reserve(rid, ids, len(ids), [], salt))
        assert reply.ok, reply
        assert await client.abort(rid)
    return reply.num_cached_blocks


def test_kv_transfer_reserve_and_router_lookup_see_only_their_own_tenants_blocks(cluster, prompts):
    ids = prompts(1)
    url = cluster.router_url  # threshold 0 and a prefill pod alive: every request is prefilled remotely
    c = Counters(cluster, url)
    ask(url, ids, A)
    assert c.delta() == {**c.zero(), "received": ALL_BLOCKS, "remote": 1}
    wait_registry_holds(cluster, ids, A, FULL_BLOCKS)
    pod = decode_pod(cluster)["pod_id"]
    assert overlaps(cluster, ids, B) == {pod: 0} and overlaps(cluster, ids, None) == {pod: 0}

    # what the prefill pod would be told: skip tenant A's 4 blocks for A, nothing for anyone else
    assert asyncio.run(reserve_probe(cluster, ids, B)) == 0
    assert asyncio.run(reserve_probe(cluster, ids, None)) == 0
    assert asyncio.run(reserve_probe(cluster, ids, A)) == FULL_BLOCKS
    c.delta()  # the probes' own prefix-cache lookups

    ask(url, ids, B)
    assert c.delta() == {**c.zero(), "received": ALL_BLOCKS, "remote": 1}
    ask(url, ids, A)
    assert c.delta() == {**c.zero(), "hits": FULL_BLOCKS * BLOCK, "received": ALL_BLOCKS - FULL_BLOCKS,
                         "skipped": FULL_BLOCKS, "router_cached": FULL_BLOCKS, "remote": 1}


# ---- (c) migration off a dead decode pod --------------------------------------------------------------------------


class RoutingLog:
    """``Dispatcher(metrics=...)``: what each placement's registry lookup found (the router's own counters
    live in its process)."""

    def __init__(self) -> None:
        self.placements: list[tuple[str, int, int]] = []

    def observe_routing(self, mode: str, pod_id: str, num_blocks: int, cached_blocks: int) -> None:
        self.placements.append((pod_id, num_blocks, cached_blocks))


async def migrate_and_finish(cluster, ids: list[int], salt: str | None,
                             local: bool) -> tuple[list[PrefillRequest], list[tuple], OutputEvent | None]:
    """Migrate a choice of tenant ``salt``, whose client already got the last 16 tokens of ``ids``, off a decode
    pod that is gone, with the router's own ``Migrator`` and ``Dispatcher`` on the ensemble's Redis and registry
    (``local``: a threshold under which the decode pod prefills it itself). Returns the ``PrefillRequest``s the
    migrator queued under the new id (read from Redis while their consumer is stopped), the placements its
    registry lookups chose, and the continued request's final output event."""
    redis = aioredis.Redis.from_url(cluster.redis_url)
    registry = RegistryClient(cluster.registry_url, token=registry_token(cluster))
    log = RoutingLog()
    config = DispatchConfig(faultkit.MODEL, local_prefill_threshold=100000 if local else 0,
                            routing=RoutingConfig(temperature=0))
    dispatcher = Dispatcher(redis, registry, config, metrics=log)
    stem = f"cmpl-{uuid.uuid4().hex}"
    job = types.SimpleNamespace(request_ids=[stem], pods=["decode-gone"])
    sent = 16
    route = ChoiceRoute(stem, "decode-gone", ids[:-sent],
                        SamplingParams(temperature=0, max_tokens=sent + 2, ignore_eos=True), salt)
    route.token_ids = list(ids[-sent:])
    consumers = cluster.names("decode" if local else "prefill")
    stream = keys.decode_stream(decode_pod(cluster)["pod_id"]) if local else keys.PREFILL_STREAM
    try:
        cluster.pause(*consumers)
        try:
            assert await Migrator(redis, dispatcher, job, 3, 1.0)(0, route, "stall")
            queued = [PrefillRequest.decode(f) for _, f in await redis.xrange(stream)]
            queued = [q for q in queued if q.request_id == route.request_id]
        finally:
            cluster.resume(*consumers)
        final = None
        out, last, deadline = keys.output_stream(route.request_id), "0", time.monotonic() + 120
        while final is None and time.monotonic() < deadline:
            for _, events in await redis.xread({out: last}, count=100, block=1000) or []:
                for msg_id, fields in events:
                    last = msg_id
                    event = OutputEvent.decode(fields)
                    if event.finish_reason or event.error:
                        final = event
        await redis.delete(out)
        return queued, log.placements, final
    finally:
        await registry.aclose()
        await redis.aclose()


@pytest.mark.parametrize("local", [False, True], ids=["remote-prefill", "local-prefill"])
def test_migrated_request_keeps_its_tenants_salt(cluster, prompts, local):
    ids = prompts(2 if not local else 5)
    pod = decode_pod(cluster)["pod_id"]
    ask(cluster.router_url, ids, A)  # tenant A's blocks on the (only live) decode pod
    wait_registry_holds(cluster, ids, A, FULL_BLOCKS)
    c = Counters(cluster, cluster.router_url)
    for salt, cached in ((B, 0), (None, 0), (A, FULL_BLOCKS)):
        queued, placements, final = asyncio.run(migrate_and_finish(cluster, ids, salt, local))
        assert len(queued) == 1, queued
        (q,) = queued
        # every token whose KV the new pod needs (the prompt, and the output the client has, which a resumed
        # request carries as output_token_ids) travels with the tenant's salt
        kv_tokens = list(q.prompt_token_ids) + list(getattr(q, "output_token_ids", None) or [])
        assert (q.cache_salt, kv_tokens, q.decode_pod_id) == (salt, ids, pod)
        assert q.request_id.endswith("~m1")
        # the new pod was chosen by the migrating tenant's own blocks only
        assert placements == [(pod, FULL_BLOCKS, cached)]
        assert final is not None and final.error is None and final.finish_reason == "length", final
        # and on the decode pod the continuation's KV is hashed with that tenant's salt
        if local:
            assert c.delta() == {**c.zero(), "hits": cached * BLOCK}
        else:
            assert c.delta() == {**c.zero(), "hits": cached * BLOCK, "received": ALL_BLOCKS - cached,
                                 "skipped": cached}


def test_an_empty_cache_salt_is_refused_not_taken_for_no_salt(cluster):
    """The block hash ignores an empty salt (``block_hash.py``), so "" would share the unsalted cache."""
    body = {"model": faultkit.MODEL, "prompt": "Hello", "max_tokens": 1, "cache_salt": ""}
    resp = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert "cache_salt" in resp.text


# ---- (a) again: no prefill tier alive ---------------------------------------------------------------------------


def test_local_prefill_with_no_prefill_tier_alive_hits_only_its_own_tenants_blocks(cluster, prompts):
    """Last in this module: it kills the prefill worker."""
    for name in cluster.names("prefill"):
        cluster.kill(name)
    gone = faultkit.wait_for(lambda: not httpx.get(f"{cluster.registry_url}/v1/pods", params={"role": "prefill"},
                                                headers=registry_headers(cluster), timeout=5).json()["pods"], 30, 0.5)
    assert gone, "the killed prefill worker never left the registry"
    before = len(routing_reasons(cluster, "router"))
    sent = local_prefill_round(cluster, cluster.router_url, prompts(3))
    assert routing_reasons(cluster, "router")[before:] == ["no prefill pod alive"] * sent


def test_local_prefill_on_a_colocated_decode_pod_hits_only_its_own_tenants_blocks(prompts, tmp_path):
    with faultkit.Cluster("--colocated", "--decode", "1", env=ENV, log_dir=tmp_path) as colocated:
        assert decode_pod(colocated)["colocated"] is True
        sent = local_prefill_round(colocated, colocated.router_url, prompts(4))
        assert routing_reasons(colocated, "router") == ["colocated decode pod"] * sent
