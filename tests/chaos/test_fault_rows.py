"""The plumbing of ``pdserve bench chaos``'s fault rows (``loadtest/faults.py``), small: the leak check on a real
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

from pdserve.loadtest import chaos, faults

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENV = {"PDSERVE_DTYPE": "float32", "PDSERVE_POD_TTL_S": "10"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with chaos.Cluster(1, 1, ENV, log_dir=tmp_path_factory.mktemp("fault_rows")) as c:
        yield c


def test_leak_check_sees_a_request_held_in_the_ensemble_and_its_release(cluster):
    probe = faults.Probe.of(cluster)
    base = faults.snapshot(probe)
    assert not any(k.endswith("unreachable") for k in base), base
    router_running = f"router {cluster.router_url} running"
    assert base[router_running] == 0
    outcome: list[chaos.Outcome] = []
    prefill = cluster.names("prefill")
    cluster.pause(*prefill)
    try:
        async def one():
            async with httpx.AsyncClient(timeout=120) as c:
                return await chaos.completion(c, cluster.router_url, chaos.prompts(1, seed=5)[0], 4)
        worker = threading.Thread(target=lambda: outcome.append(asyncio.run(one())))
        worker.start()
        seen: dict[str, int] = {}

        def router_holds_it() -> bool:
            seen.update(faults.leaks(probe, base, settle_s=0))
            return router_running in seen
        chaos.wait_for(router_holds_it, 60, 0.2)
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
