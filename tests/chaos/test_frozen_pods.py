"""Frozen pods (``kill -STOP`` / ``kill -CONT``) that used to fail requests, now routed around or waited for: real
processes (the children ``pdserve up`` starts: 1 prefill and 1 decode worker, router, registry, redis-server), the
real model, one ensemble for the three cases. Short timeouts, set through settings, keep it quick: the router moves
a stalled prefill after 4 s, a pod leaves the registry 4 s after its last heartbeat, and the decode pod's KV lease
is the least the decode settings accept for that stall check (4 + 10 s: the boundary).

Oracles: the same ensemble's uninterrupted greedy answers (text and completion_tokens), the router's log naming
why a request moved or waited, the decode pod's ``/v1/stats`` (a lease held while the prefill pod is frozen).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pdserve.loadtest import chaos
from pdserve.services.decode.settings import LEASE_MARGIN_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STALL_S = 4
ENV = {
    "PDSERVE_PREFILL_STALL_S": str(STALL_S),
    "PDSERVE_LEASE_TTL_S": str(STALL_S + LEASE_MARGIN_S),  # the boundary: any shorter is refused
    "PDSERVE_MIGRATION_STALL_S": "1",
    "PDSERVE_POD_TTL_S": "4",
    "PDSERVE_CLAIM_IDLE_S": "300",  # the prefill pod's own reclaiming cannot be what rescues a request here
    "PDSERVE_PD_POLICY": "threshold",  # remote prefill whenever a prefill pod is alive
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with chaos.Cluster("--prefill", "1", "--decode", "1", env=ENV, log_dir=tmp_path_factory.mktemp("frozen")) as c:
        yield c


def summary(outcomes) -> str:
    return "\n".join(f"{o.kind} status={o.status} error={o.error} exc={o.exception} finish={o.finish_reason} "
                     f"tokens={o.completion_tokens} latency={o.latency_s:.1f} text={o.text!r}" for o in outcomes)


def healthy(cluster) -> bool:
    try:
        return all(httpx.get(cluster.child(n).health_url, timeout=5).status_code == 200
                   for n in ("router", "registry", "prefill-0", "decode-0"))
    except httpx.HTTPError:
        return False


def recovered(cluster) -> None:
    """Everything resumed, answering, and back in the registry (a heartbeat after /health answers)."""
    cluster.resume("prefill-0", "decode-0")
    assert chaos.wait_for(lambda: healthy(cluster), 60, 0.5)
    time.sleep(2)


def run(cluster, texts, max_tokens, fault, **extra) -> list[chaos.Outcome]:
    """Stream ``texts`` at once (each bounded by 90 s); ``fault()`` runs in a thread once they are sent."""
    first = threading.Event()

    async def one(client, prompt):
        try:
            return await asyncio.wait_for(chaos.completion(client, cluster.router_url, prompt, max_tokens,
                                                           on_token=lambda n: first.set(), **extra), 90)
        except asyncio.TimeoutError:
            return chaos.Outcome(exception="no answer within 90 s", latency_s=90)

    async def main():
        async with httpx.AsyncClient(timeout=90) as client:
            tasks = [asyncio.create_task(one(client, p)) for p in texts]
            await asyncio.to_thread(fault, first)
            return await asyncio.gather(*tasks)
    return asyncio.run(main())


def test_a_prefill_pod_frozen_holding_a_kv_lease_is_moved_before_the_lease_expires(cluster):
    """The prefill pod freezes after its Reserve reached the decode pod (so the decode pod holds a lease for it):
    the router moves the request when its queue entry has gone untouched for the stall check, while the lease still
    stands (lease = stall + margin, the least accepted), and it completes with the uninterrupted text; the pod,
    woken after the lease's end, fails nothing."""
    texts = chaos.prompts(1, words=30, seed=41)
    want = asyncio.run(chaos.reference(cluster.router_url, texts, 12))  # also warms the KV-transfer connection
    leases = []

    def fault(first):
        cluster.pause("decode-0")  # the Reserve the prefill pod sends after the first token waits unanswered
        assert first.wait(30), "no first token"
        time.sleep(0.5)
        cluster.pause("prefill-0")
        cluster.resume("decode-0")  # it opens the lease and answers a frozen prefill pod
        time.sleep(1)
        leases.append(cluster.stats("decode-0").get("kv_active_leases"))
        time.sleep(STALL_S + LEASE_MARGIN_S)  # past the lease's end
        cluster.resume("prefill-0")

    try:
        outcomes = run(cluster, texts, 12, fault)
    finally:
        recovered(cluster)
    chaos.check(outcomes, want)
    assert leases == [1], leases
    assert all(o.kind == "completed" and not o.wrong for o in outcomes), summary(outcomes)
    assert "prefill stalled: worker prefill-0 has not touched it" in cluster.log("router")
    assert chaos.wait_for(lambda: cluster.stats("decode-0").get("kv_active_leases") == 0, 20, 0.5)
    assert "no lease" not in cluster.log("prefill-0")


def test_the_only_decode_pod_frozen_then_resumed_is_waited_for_not_failed(cluster):
    """Frozen 12 s mid-generation (past its registry TTL and the router's /health probe: it left the registry and
    does not answer), then resumed: its requests complete with the uninterrupted text instead of an error chunk."""
    texts = chaos.prompts(3, words=30, seed=42)
    want = asyncio.run(chaos.reference(cluster.router_url, texts, 24, ignore_eos=True))

    def fault(first):
        assert first.wait(30), "no first token"
        cluster.pause("decode-0")
        time.sleep(12)
        cluster.resume("decode-0")

    try:
        outcomes = run(cluster, texts, 24, fault, ignore_eos=True)
    finally:
        recovered(cluster)
    chaos.check(outcomes, want)
    assert all(o.kind == "completed" and not o.wrong for o in outcomes), summary(outcomes)
    assert all(o.latency_s >= 12 for o in outcomes), summary(outcomes)
    assert "accepts connections but does not answer (stopped?)" in cluster.log("router")


def test_the_only_prefill_pod_frozen_queued_short_requests_go_to_local_prefill(cluster):
    """The prefill pod freezes; short requests queued for it move to the decode pod's local prefill once the pod
    has left the registry (seconds), instead of a 503 after the stall check; they complete with the uninterrupted
    text."""
    texts = chaos.prompts(3, words=30, seed=43)
    want = asyncio.run(chaos.reference(cluster.router_url, texts, 8))
    cluster.pause("prefill-0")
    try:
        outcomes = run(cluster, texts, 8, lambda first: None)
    finally:
        recovered(cluster)
    chaos.check(outcomes, want)
    assert all(o.kind == "completed" and not o.wrong for o in outcomes), summary(outcomes)
    assert all(o.latency_s < 30 for o in outcomes), summary(outcomes)
    log = cluster.log("router")
    assert "no prefill pod is alive" in log or "prefill stalled: worker prefill-0" in log
