"""The plumbing of ``pdserve bench chaos``'s fault rows (``pdserve/loadtest/faults.py``), small: the leak check on a real
ensemble, and the cheapest row (item 11, a prompt list under admission limits). The whole table is a benchmark
(``python -m pdserve.loadtest.chaos``), not CI.

Oracles: the router's ``pdserve:num_requests_running`` gauge while a request is held (the leak check must see
it, then see it go), and the admission limit (a list longer than it is refused, never admitted or left hanging).
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from pdserve.loadtest import chaos, faultkit, faults
from pdserve.shared.protocol import keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENV = {"PDSERVE_DTYPE": "float32", "PDSERVE_POD_TTL_S": "10"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with faultkit.Cluster("--prefill", "1", "--decode", "1",
                          env=ENV, log_dir=tmp_path_factory.mktemp("fault_rows")) as c:
        yield c


def test_leak_check_sees_a_request_held_in_the_ensemble_and_its_release(cluster):
    probe = faults.Probe.of(cluster)
    base = faults.snapshot(probe)
    assert not any(k.endswith("unreachable") for k in base), base
    router_running = f"router {cluster.router_url} running"
    assert base[router_running] == 0
    outcome: list[faultkit.Outcome] = []
    prefill = cluster.names("prefill")
    cluster.pause(*prefill)
    try:
        async def one():
            async with httpx.AsyncClient(timeout=120) as c:
                return await faultkit.completion(c, cluster.router_url, faultkit.prompts(1, seed=5)[0], 4)
        worker = threading.Thread(target=lambda: outcome.append(asyncio.run(one())))
        worker.start()
        seen: dict[str, int] = {}

        def router_holds_it() -> bool:
            seen.update(faults.leaks(probe, base, settle_s=0))
            return router_running in seen
        faultkit.wait_for(router_holds_it, 60, 0.2)
    finally:
        cluster.resume(*prefill)
    worker.join(120)
    assert seen.get(router_running) == 1, seen
    assert outcome and outcome[0].kind == "completed", outcome
    assert faults.leaks(probe, base, settle_s=30) == {}
    assert faults.leak_text({}) == "0"


def test_prompt_list_longer_than_the_admission_limit_is_refused_not_hung(cluster):
    router = cluster.extra_router({"PDSERVE_MAX_QUEUED_REQUESTS": "4"})
    url = router.health_url.removesuffix("/health")
    probe = faults.Probe.of(cluster)
    base = faults.snapshot(probe)
    tally = asyncio.run(faults.prompt_list(url, 4, lists=(20, 2000), bound_s=60))
    detail = [(o.status, o.error, o.exception) for o in tally.outcomes]
    assert tally.count("lost") == 0, detail
    assert tally.failures == [], detail
    assert all(o.status in (400, 429) for o in tally.outcomes), detail
    assert faults.leaks(probe, base, settle_s=30) == {}


def test_request_a_live_decode_pod_stops_holding_moves_instead_of_hanging(cluster):
    """A decode pod that, alive and healthy, stops holding a request it took over (its orphan reaper drops the
    requests of a router whose key Redis lost for a while; here an abort only that pod hears) must not leave the
    stream silent until the 600 s request timeout: past the watch's stall bound the router asks the pod, and a
    pod that says twice it does not hold the request has the request moved. Oracle: the greedy reference text.

    First a write pause in Redis (``CLIENT PAUSE ... WRITE``) silences the stream while the pod holds the request,
    so the router's watch has already seen the hand-over (the state in which the old router never asked again)."""
    router = cluster.extra_router({"PDSERVE_PREFILL_STALL_S": "3"})
    url = router.health_url.removesuffix("/health")
    text = faultkit.prompts(1, seed=12)[0]
    tokens = 256  # the engine keeps going during the pause: enough left to drop afterwards
    want = asyncio.run(chaos.reference(url, [text], tokens, ignore_eos=True))[0]
    r = cluster.redis()
    before = chaos.relayed_request_ids(r)
    progress = [0]

    async def run() -> faultkit.Outcome:
        async with httpx.AsyncClient(timeout=300) as c:
            task = asyncio.create_task(faultkit.completion(c, url, text, tokens, ignore_eos=True,
                                                        on_token=lambda n: progress.__setitem__(0, n)))
            while progress[0] < 2 and not task.done():
                await asyncio.sleep(0.01)
            (request_id,) = chaos.relayed_request_ids(r) - before
            r.execute_command("CLIENT", "PAUSE", "3500", "WRITE")
            await asyncio.sleep(3.6)
            seen = progress[0]
            while progress[0] == seen and not task.done():
                await asyncio.sleep(0.01)
            r.publish(keys.ABORT_CHANNEL, request_id)
            return await asyncio.wait_for(task, 120)

    got = asyncio.run(run())
    assert got.kind == "completed", (got.status, got.error, got.exception)
    assert got.text == want.text and got.completion_tokens == tokens
    assert "no longer holds it" in cluster.log(router.name), cluster.log(router.name)[-3000:]
