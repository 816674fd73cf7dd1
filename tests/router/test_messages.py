"""Stream messages survive a real Redis round trip (XADD/XREAD return bytes keys and values)."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import BadSamplingParams, MessageError, OutputEvent, PrefillRequest, TokenLogprob
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.worker.output_writer import OutputWriter


def roundtrip(redis_client, stream, fields):
    redis_client.xadd(stream, fields)
    ((_, [(_, got)]),) = redis_client.xread({stream: "0-0"}, count=1)
    return got


def test_prefill_request_round_trips_through_redis(redis_client):
    req = PrefillRequest(
        request_id="chatcmpl-1-0", model="smollm2-135m-instruct", prompt_token_ids=list(range(1, 40)),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=5, stop=["\n"]),
        decode_pod_id="decode-0", decode_host="10.0.0.7", decode_kv_port=9000, arrival_time=1_700_000_000.25,
        deadline=None, cache_salt="salt", priority=-1, choice_index=2)
    fields = roundtrip(redis_client, keys.PREFILL_STREAM, req.encode())
    assert PrefillRequest.decode(fields) == req
    assert fields[b"prompt_tokens"] == b"39"  # the planner sums this without unpacking
    assert isinstance(PrefillRequest.decode(fields).sampling_params, SamplingParams)


def test_a_prefill_request_with_invalid_sampling_params_names_its_request():
    req = PrefillRequest(request_id="cmpl-9-0", model="m", prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                         decode_pod_id="d", decode_host="h", decode_kv_port=1, arrival_time=0.0)
    fields = req.encode()
    payload = msgpack.unpackb(fields["data"])
    payload["sampling_params"]["temperature"] = -1.0
    with pytest.raises(BadSamplingParams) as err:
        PrefillRequest.decode({**fields, "data": msgpack.packb(payload)})
    assert err.value.request_id == "cmpl-9-0" and "temperature" in str(err.value)
    payload["sampling_params"] = "not a map"
    with pytest.raises(MessageError) as err:
        PrefillRequest.decode({**fields, "data": msgpack.packb(payload)})
    assert not isinstance(err.value, BadSamplingParams)


def test_output_event_round_trips_with_logprobs(redis_client):
    event = OutputEvent("r", index=1, token_ids=[5, 6], text="Paris.", finish_reason="stop",
                        logprobs=[TokenLogprob(5, -0.5, [(5, -0.5), (9, -1.0)]), TokenLogprob(6, -0.1, [])],
                        prompt_tokens=12, completion_tokens=7, stop_reason=None, first_token_time=3.5,
                        num_cached_tokens=16)
    fields = roundtrip(redis_client, keys.output_stream("r"), event.encode())
    assert OutputEvent.decode(fields) == event
    assert fields[b"final"] == b"1"


def test_error_event_is_final():
    event = OutputEvent("r", error={"message": "boom", "type": "InternalServerError", "code": 500})
    assert event.finished and OutputEvent.decode(event.encode()).error["code"] == 500
    assert not OutputEvent("r", token_ids=[1]).finished


def test_decoder_ignores_unknown_fields_from_a_newer_writer():
    payload = msgpack.packb({"request_id": "r", "text": "x", "something_new": [1, 2]})
    assert OutputEvent.decode({b"data": payload}) == OutputEvent("r", text="x")


@pytest.mark.parametrize("fields", [{}, {b"data": b"\xc1"}, {b"data": msgpack.packb([1, 2])},
                                    {b"data": msgpack.packb({"model": "m"})}])
def test_garbage_entries_raise_message_error(fields):
    with pytest.raises(MessageError):
        PrefillRequest.decode(fields)


def test_output_writer_sets_a_ttl_and_skips_aborted_requests(redis_client):
    writer = OutputWriter(redis_client)
    assert writer.write(OutputEvent("live", token_ids=[1], text="a")) == 1
    assert OutputEvent.decode(redis_client.xrange(keys.output_stream("live"))[0][1]).text == "a"
    assert 0 < redis_client.ttl(keys.output_stream("live")) <= keys.OUTPUT_TTL_S
    redis_client.set(keys.aborted_key("gone"), 1)
    assert writer.write(OutputEvent("gone", token_ids=[1], text="a")) == 0
    assert not redis_client.exists(keys.output_stream("gone"))


def test_output_writer_batches_in_a_pipeline_and_works_with_asyncio(redis_url, redis_client):
    import asyncio

    import redis.asyncio as aioredis

    pipe = redis_client.pipeline(transaction=False)
    writer = OutputWriter(redis_client)
    for rid in ("a", "b"):
        writer.write(OutputEvent(rid, token_ids=[2], text="x"), client=pipe)
    assert pipe.execute() == [1, 1]

    async def write_async() -> int:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await OutputWriter(client).write(OutputEvent("c", finish_reason="stop"))
        finally:
            await client.aclose()

    assert asyncio.run(write_async()) == 1
    assert redis_client.xlen(keys.output_stream("c")) == 1
