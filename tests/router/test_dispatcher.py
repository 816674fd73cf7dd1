"""``Dispatcher.dispatch``: one call places a prompt's choices, builds their ``PrefillRequest``s and enqueues
them; ``DispatchConfig.from_settings`` carries every routing setting. A real redis-server; pods from an
in-memory directory (the placement policies have their own tests in tests/routing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from redis.asyncio import Redis

from pdserve.services.router.dispatch import ChoiceSpec, DispatchConfig, Dispatcher, RoutingConfig
from pdserve.services.router.pd_policy import PolicyConfig
from pdserve.services.router.settings import RouterSettings
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams

IDS = list(range(100, 140))


class Directory:
    def __init__(self, prefill: bool = True) -> None:
        self.listed = {"decode": [SimpleNamespace(pod_id="decode-0", host="10.0.0.7", kv_port=9200, free_blocks=50,
                                                  num_running=0, num_waiting=0, colocated=False)],
                       "prefill": [SimpleNamespace(pod_id="prefill-0")] if prefill else []}

    async def list_pods(self, role: str):
        return list(self.listed[role])


def expected(request_id: str, choice_index: int, params: dict, **extra) -> PrefillRequest:
    return PrefillRequest(request_id=request_id, model="m", prompt_token_ids=IDS,
                          sampling_params=SamplingParams(**params),
                          decode_pod_id="decode-0", decode_host="10.0.0.7", decode_kv_port=9200, arrival_time=1000.0,
                          cache_salt="salt", priority=3, choice_index=choice_index, router_id="r1", **extra)


@pytest.mark.asyncio
async def test_dispatch_enqueues_exactly_the_choices_on_the_prefill_queue(redis_url, redis_client):
    redis = Redis.from_url(redis_url)
    dispatcher = Dispatcher(redis, Directory(), DispatchConfig("m", cache_s=0.0), router_id="r1")
    choices = [ChoiceSpec("req-0", 0, SamplingParams(max_tokens=4, seed=1)),
               ChoiceSpec("req-1", 1, SamplingParams(max_tokens=4, seed=2))]
    sent = await dispatcher.dispatch(IDS, choices, cache_salt="salt", priority=3, arrival_time=1000.0)
    stored = redis_client.xrange(keys.PREFILL_STREAM)
    assert [PrefillRequest.decode(fields) for _, fields in stored] == [
        expected("req-0", 0, {"max_tokens": 4, "seed": 1}), expected("req-1", 1, {"max_tokens": 4, "seed": 2})]
    assert (sent.stream, sent.entries) == (keys.PREFILL_STREAM, [entry.decode() for entry, _ in stored])
    assert sent.requests == [expected("req-0", 0, {"max_tokens": 4, "seed": 1}),
                             expected("req-1", 1, {"max_tokens": 4, "seed": 2})]
    assert (sent.placement.pod.pod_id, sent.placement.local_prefill) == ("decode-0", False)
    assert dict(dispatcher.in_flight) == {"decode-0": 2}
    dispatcher.finished("decode-0", 2)
    assert dict(dispatcher.in_flight) == {}
    await redis.aclose()


@pytest.mark.asyncio
async def test_a_local_prefill_goes_to_the_decode_pods_own_stream_with_its_group_at_zero(redis_url, redis_client):
    redis = Redis.from_url(redis_url)
    dispatcher = Dispatcher(redis, Directory(prefill=False), DispatchConfig("m", cache_s=0.0, fallback_max_tokens=64),
                            router_id="r1")
    resumed = ChoiceSpec("req-0~m1", 0, SamplingParams(max_tokens=8), output_token_ids=[7, 8], output_text_len=5)
    sent = await dispatcher.dispatch(IDS, [resumed], cache_salt="salt", priority=3, arrival_time=1000.0)
    stream = keys.decode_stream("decode-0")
    assert (sent.stream, sent.placement.reason) == (stream, "no prefill pod alive")
    assert [PrefillRequest.decode(f) for _, f in redis_client.xrange(stream)] == [
        expected("req-0~m1", 0, {"max_tokens": 8}, output_token_ids=[7, 8], output_text_len=5)]
    assert not redis_client.exists(keys.PREFILL_STREAM)
    (group,) = redis_client.xinfo_groups(stream)
    assert (group["name"].decode(), group["last-delivered-id"].decode()) == (keys.DECODE_GROUP, "0-0")
    await redis.aclose()


def test_dispatch_config_from_settings_carries_every_value():
    settings = RouterSettings(model="some-model", registry_cache_s=1.5, local_prefill_threshold=40,
                              local_prefill_fallback_max_tokens=300, retry_after_s=4, routing_mode="round_robin",
                              routing_load_weight=2.5, routing_temperature=0.5, pd_policy="threshold",
                              ttft_slo_ms=500, tpot_slo_ms=50, prefill_tokens_per_s=4000, max_num_batched_tokens=512)
    assert DispatchConfig.from_settings(settings) == DispatchConfig(
        model="some-model", cache_s=1.5, local_prefill_threshold=40, fallback_max_tokens=300, retry_after_s=4,
        routing=RoutingConfig("round_robin", 2.5, 0.5), pd_policy="threshold",
        policy=PolicyConfig(40, 300, 500, 50, 4000, 512))
    # the fallback never sends fewer tokens to a decode pod than the threshold does
    assert Dispatcher(None, Directory(), DispatchConfig(local_prefill_threshold=500)).fallback_max_tokens == 500
