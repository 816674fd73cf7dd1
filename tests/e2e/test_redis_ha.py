"""``pdserve up`` on a Redis that scales out and one that fails over, both from the real ``redis-server`` binary
(tests/support/redis_ha.py): a 3-shard Redis Cluster serves streamed requests through the prefill tier exactly as
a single Redis does, and with Redis Sentinel a SIGKILLed primary (AOF on) costs a pause, not a request."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from pdserve.loadtest.cluster import Cluster
from support.ensemble import stream_completion
from support.redis_ha import RedisClusterServers, SentinelGroup

MODEL = "smollm2-135m-instruct"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS = ["The capital of France is", "Once upon a time, a lighthouse keeper", "The three primary colors are",
           "Water boils at", "A haiku about the sea:", "The largest planet is"]


def body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_an_ensemble_on_a_three_shard_cluster_serves_streamed_requests(tmp_path):
    with RedisClusterServers(shards=3) as cluster, \
            Cluster("--prefill", "1", "--decode", "1", "--dtype", "float32", log_dir=tmp_path,
                    env={"PDSERVE_REDIS_URL": cluster.url}, process=True) as ens:
        # oracle: each prompt alone, then all at once (batched on the decode pod) must give the same greedy text
        alone = [stream_completion(ens, body(p, 12)) for p in PROMPTS[:2]]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: stream_completion(ens, body(p, 12)), PROMPTS))
        calls = cluster.commandstats()
    assert together[:2] == alone and all(finish == "length" and text for text, finish in together)
    assert sum(1 for c in calls if c > 0) >= 2, calls  # queue, pods and router keys live on different shards


def test_a_sentinel_failover_under_load_loses_no_request(tmp_path):
    with SentinelGroup(aof_dir=tmp_path / "redis") as group, \
            Cluster("--colocated", "--decode", "1", "--dtype", "float32", log_dir=tmp_path / "logs",
                    env={"PDSERVE_REDIS_URL": group.url, "PDSERVE_MIGRATION_STALL_S": "5"}, process=True) as ens:
        want = {p: stream_completion(ens, body(p, 24))[0] for p in PROMPTS}
        killed: dict = {}

        def kill_once(text: str) -> None:
            if not killed and len(text) > 10:
                killed["port"] = group.kill_primary()
                killed["at"] = time.monotonic()

        def one(i: int, prompt: str) -> tuple[str, str | None]:
            return stream_completion(ens, body(prompt, 24), kill_once if i == 0 else None, timeout_s=120)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(one, range(len(PROMPTS)), PROMPTS))
        new_port = group.wait_failover(killed["port"])
        after = stream_completion(ens, body(PROMPTS[0], 24))  # served on the promoted replica
    assert killed and new_port != killed["port"]
    assert [text for text, _ in got] == [want[p] for p in PROMPTS] and all(f == "length" for _, f in got)
    assert after == (want[PROMPTS[0]], "length")
