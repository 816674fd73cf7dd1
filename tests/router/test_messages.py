"""Stream messages survive a real Redis round trip (XADD/XREAD return bytes keys and values)."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import MessageError, OutputEvent, PrefillRequest, TokenLogprob


def roundtrip(redis_client, stream, fields):
    redis_client.xadd(stream, fields)
    ((_, [(_, got)]),) = redis_client.xread({stream: "0-0"}, count=1)
    return got


def test_prefill_request_round_trips_through_redis(redis_client):
    req = PrefillRequest(
        request_id="chatcmpl-1-0", model="smollm2-135m-instruct", prompt_token_ids=list(range(1, 40)),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=5, stop=["\n"]).to_dict(),
        decode_pod_id="decode-0", decode_host="10.0.0.7", decode_kv_port=9000, arrival_time=1_700_000_000.25,
        deadline=None, cache_salt="salt", priority=-1, choice_index=2)
    fields = roundtrip(redis_client, keys.PREFILL_STREAM, req.encode())
    assert PrefillRequest.decode(fields) == req
    assert fields[b"prompt_tokens"] == b"39"  # the planner sums this without unpacking
    assert SamplingParams.from_dict(PrefillRequest.decode(fields).sampling_params).max_tokens == 5


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
