"""Requests never wait on a prefill worker that stopped, nor on queue state that Redis lost:
real processes (the children ``pdserve up`` starts: 2 prefill workers, 1 decode worker, router, registry), a
real redis-server without persistence that this module owns, the real model.

Oracles: the same ensemble's uninterrupted greedy answers (text and completion_tokens), every service's
``/health``, the router's log naming why a request moved. ``claim_idle_s`` is 300 s, so the prefill workers'
own reclaiming (XAUTOCLAIM) cannot be what rescues a request here: only the router's prefill watch can.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.loadtest import chaos, faultkit
from pdserve.shared.protocol import keys
from support.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BOUND_S = 90  # what a request may take here at most; without the watch it waits claim_idle_s (300 s) or forever
ENV = {
    "PDSERVE_DTYPE": "float32",
    "PDSERVE_CLAIM_IDLE_S": "300",
    "PDSERVE_PREFILL_STALL_S": "4",
    "PDSERVE_MIGRATION_STALL_S": "1",
    "PDSERVE_POD_TTL_S": "10",  # a decode pod stopped for a few seconds stays listed
}


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:  # no persistence: `pdserve up`'s default
        yield server


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory):
    with faultkit.Cluster("--prefill", "2", "--decode", "1", "--redis-url", redis_server.url,
                          env=ENV, log_dir=tmp_path_factory.mktemp("liveness")) as c:
        yield c


def summary(outcomes) -> str:
    return "\n".join(f"{o.kind} status={o.status} error={o.error} exc={o.exception} finish={o.finish_reason} "
                     f"tokens={o.completion_tokens} latency={o.latency_s:.1f} text={o.text!r}" for o in outcomes)


def healthy(cluster) -> bool:
    names = ["router", "registry", *cluster.names("prefill"), *cluster.names("decode")]
    try:
        return all(httpx.get(cluster.child(n).health_url, timeout=5).status_code == 200 for n in names)
    except httpx.HTTPError:
        return False


def pending_of(r, consumer: str) -> int:
    try:
        return sum(int(c["pending"]) for c in r.xinfo_consumers(keys.PREFILL_STREAM, keys.PREFILL_GROUP)
                   if c["name"] in (consumer, consumer.encode()))
    except Exception:
        return 0


def run_with_fault(cluster, texts, max_tokens, fault) -> list[faultkit.Outcome]:
    """Stream ``texts`` at once; ``fault()`` runs (in a thread) once they are sent; every outcome, each within
    BOUND_S."""
    async def bounded(client, prompt):
        try:  # a whole-request bound: a stream kept open by keep-alives never hits a read timeout
            return await asyncio.wait_for(faultkit.completion(client, cluster.router_url, prompt, max_tokens), BOUND_S)
        except asyncio.TimeoutError:
            return faultkit.Outcome(exception=f"no answer within {BOUND_S} s", latency_s=BOUND_S)

    async def run():
        async with httpx.AsyncClient(timeout=BOUND_S) as client:
            tasks = [asyncio.create_task(bounded(client, p)) for p in texts]
            await asyncio.to_thread(fault)
            return await asyncio.gather(*tasks)
    return asyncio.run(run())


def test_requests_held_by_a_stopped_prefill_worker_move_to_the_other_one(cluster):
    texts = faultkit.prompts(4, words=40, seed=21)
    want = asyncio.run(chaos.reference(cluster.router_url, texts, 8))
    r = cluster.redis()
    cluster.pause("decode-0", "prefill-1")  # prefill-0 takes every request; no hand-over can finish

    def fault():
        held = faultkit.wait_for(lambda: pending_of(r, "prefill-0") >= len(texts), 30, 0.1)
        cluster.pause("prefill-0")  # hung while it holds them (SIGSTOP)
        cluster.resume("decode-0", "prefill-1")
        assert held, f"prefill-0 never held the requests: {pending_of(r, 'prefill-0')}"

    try:
        outcomes = run_with_fault(cluster, texts, 8, fault)
    finally:
        cluster.resume("decode-0", "prefill-0", "prefill-1")
        r.close()
    chaos.check(outcomes, want)
    assert all(o.kind == "completed" and not o.wrong for o in outcomes), summary(outcomes)
    assert "prefill stalled: worker prefill-0 has not touched it" in cluster.log("router")
    # the stopped worker, woken up, finds its requests aborted and lets them go: nothing stays pending
    assert faultkit.wait_for(lambda: faultkit.leftovers(cluster)["pending"] == 0, 60, 0.5), faultkit.leftovers(cluster)


@pytest.mark.parametrize("loss", ["flushall", "restart_empty"])
def test_requests_queued_when_redis_loses_its_data_are_served_and_the_ensemble_recovers(cluster, redis_server, loss):
    texts = faultkit.prompts(3, words=40, seed=22 if loss == "flushall" else 23)
    want = asyncio.run(chaos.reference(cluster.router_url, texts, 8))
    r = cluster.redis()
    base = r.xlen(keys.PREFILL_STREAM)
    prefill = cluster.names("prefill")
    cluster.pause(*prefill)  # the requests wait in the queue, which Redis then loses

    def fault():
        queued = faultkit.wait_for(lambda: r.xlen(keys.PREFILL_STREAM) >= base + len(texts), 30, 0.1)
        if loss == "flushall":
            r.flushall()
        else:
            redis_server.restart(kill=True)  # kill -9, started again empty
        cluster.resume(*prefill)
        assert queued, "the requests never reached the prefill queue"

    try:
        outcomes = run_with_fault(cluster, texts, 8, fault)
    finally:
        cluster.resume(*prefill)
        r.close()
    chaos.check(outcomes, want)
    assert all(o.kind == "completed" and not o.wrong for o in outcomes), summary(outcomes)
    assert "its queue entry and its state vanished" in cluster.log("router")
    assert faultkit.wait_for(lambda: healthy(cluster), 30, 0.5)
    # and new requests are served, with no restart
    again = asyncio.run(chaos.reference(cluster.router_url, texts[:1], 8))[0]
    assert again.kind == "completed" and again.text == want[0].text, again
