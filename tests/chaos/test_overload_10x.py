"""10x overload on real processes (``pdserve up``'s children, 1 prefill + 1 decode worker, the real model): the
router's admission limits must answer every request, completed or a clear 429 with ``Retry-After``, and the
ensemble must come out of it alive with nothing left behind.

Oracles: each request's own answer (status, error body, ``[DONE]``), every process's liveness and ``/health``,
the workers' counters and Redis keys (``faultkit.leftovers``). No timing or memory thresholds: those are
measured by ``python -m pdserve.loadtest.overload`` (tests/chaos/README.md "10x overload").
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.loadtest import faultkit, overload

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_QUEUED = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = {**overload.limits_env(MAX_QUEUED, 256), "PDSERVE_POD_TTL_S": "30"}  # pods stopped for a while stay listed
    with faultkit.Cluster("--prefill", "1", "--decode", "1", env=env, log_dir=tmp_path_factory.mktemp("ten_x")) as c:
        yield c


def summary(outcomes) -> str:
    return "\n".join(f"{o.kind} status={o.status} retry_after={o.retry_after} error={o.error} exc={o.exception}"
                     for o in outcomes if o.kind != "completed")


def test_ten_x_burst_is_answered_clearly_and_leaves_nothing_behind(cluster):
    result = overload.run(cluster, clients=MAX_QUEUED, measure_s=4, duration_s=6, baseline_s=0, max_tokens=8)
    ten = result.ten_x
    assert len(ten.outcomes) > 0
    assert ten.count("lost") == 0 and result.sustainable.count("lost") == 0, summary(ten.outcomes)
    assert ten.count("completed") + ten.count("clear_error") == len(ten.outcomes)
    # ten times what the cluster completes, at most 4 waiting: admission must have turned some away, clearly
    assert ten.rejected > 0 and ten.count("completed") > 0, summary(ten.outcomes)
    for o in ten.outcomes:
        if o.status == 429:
            assert o.retry_after == "1" and o.error["type"] == "RateLimitError", summary([o])
            assert "waiting for prefill or a decode slot" in o.error["message"]
    assert ten.other_errors == 0, summary(ten.outcomes)
    assert all(result.alive.values()), result.alive
    assert result.clean, result.leftovers


@pytest.fixture(scope="module")
def unlimited_url(cluster):
    """A second router on the same ensemble, without admission limits."""
    router = cluster.extra_router({"PDSERVE_MAX_QUEUED_REQUESTS": "0", "PDSERVE_MAX_QUEUED_PROMPT_TOKENS": "0"})
    return router.health_url.removesuffix("/health")


def test_more_requests_in_flight_than_redis_pool_default_all_complete(cluster, unlimited_url):
    """Each request in flight holds one of the router's Redis connections while it waits for output; redis-py's
    default pool (100) used to answer the 101st with 503 "The request queue (Redis) is unavailable"."""
    url = unlimited_url
    base = faultkit.leftovers(cluster)
    texts = overload.workload(150, 12, seed=31)

    async def burst():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1000)) as client:
            return await asyncio.gather(*[faultkit.completion(client, url, t, 2) for t in texts])

    outcomes = asyncio.run(burst())
    assert sum(o.kind == "completed" for o in outcomes) == len(texts), summary(outcomes)
    ok, left = overload.clean_after(cluster, base)
    assert ok, left

