"""The prefill backlog read from a real redis-server, against the tokens the test itself enqueued."""

from __future__ import annotations

import redis

from pdserve.services.planner.backlog import read_backlog
from pdserve.shared.protocol.keys import PREFILL_GROUP, PREFILL_STREAM
from pdserve.shared.protocol.messages import PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams


def enqueue(r: redis.Redis, n_tokens: int, request_id: str) -> None:
    msg = PrefillRequest(request_id=request_id, model="m", prompt_token_ids=list(range(n_tokens)),
                         sampling_params=SamplingParams(), decode_pod_id="d-0", decode_host="127.0.0.1",
                         decode_kv_port=9000, arrival_time=0.0)
    r.xadd(PREFILL_STREAM, msg.encode())


def test_empty_when_there_is_no_stream(redis_server):
    b = read_backlog(redis.Redis.from_url(redis_server.url))
    assert (b.tokens, b.entries, b.stream_length) == (0, 0, 0)


def test_waiting_and_pending_tokens_are_summed_from_the_entries(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    r.xgroup_create(PREFILL_STREAM, PREFILL_GROUP, id="0", mkstream=True)
    sizes = [100, 250, 40, 1000, 7, 333]
    for i, n in enumerate(sizes):
        enqueue(r, n, f"req-{i}")
    # A worker took the first two (pending) ...
    got = r.xreadgroup(PREFILL_GROUP, "prefill-0", {PREFILL_STREAM: ">"}, count=2)
    # ... and finished the first (acknowledged).
    r.xack(PREFILL_STREAM, PREFILL_GROUP, got[0][1][0][0])
    b = read_backlog(r)
    assert (b.waiting_entries, b.pending_entries) == (4, 1)
    assert (b.waiting_tokens, b.pending_tokens) == (40 + 1000 + 7 + 333, 250)
    assert b.tokens == sum(sizes) - 100
    assert b.stream_length == 6


def test_a_stream_without_its_group_is_all_waiting(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    for i, n in enumerate([10, 20, 30]):
        enqueue(r, n, f"r{i}")
    b = read_backlog(r)
    assert (b.waiting_entries, b.pending_entries, b.tokens) == (3, 0, 60)


def test_beyond_the_read_cap_the_count_is_extrapolated(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    r.xgroup_create(PREFILL_STREAM, PREFILL_GROUP, id="0", mkstream=True)
    for i in range(50):
        enqueue(r, 64, f"r{i}")
    b = read_backlog(r, max_entries=10)
    assert b.waiting_tokens == 50 * 64
