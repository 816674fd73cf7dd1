"""Worker output publishing against a real redis-server: events land on their request's stream, a
final event arms the stream's TTL, and an aborted request's stream is never recreated."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent
from pdserve.shared.worker.events import publish
from pdserve.shared.worker.output_writer import OutputWriter


def test_publish_writes_events_and_skips_aborted(redis_url):
    async def scenario():
        r = aioredis.from_url(redis_url)
        writer = OutputWriter(r)
        await r.set(keys.aborted_key("gone"), 1)
        await publish(writer, r, [
            OutputEvent("a", token_ids=[1], text="x"),
            OutputEvent("a", token_ids=[2], text="y", finish_reason="stop", completion_tokens=2),
            OutputEvent("gone", token_ids=[3], text="z"),
        ])
        entries = await r.xrange(keys.output_stream("a"))
        ttl = await r.ttl(keys.output_stream("a"))
        exists = await r.exists(keys.output_stream("gone"))
        await r.aclose()
        return entries, ttl, exists

    entries, ttl, exists = asyncio.run(scenario())
    events = [OutputEvent.decode(fields) for _, fields in entries]
    assert [e.text for e in events] == ["x", "y"]
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == 2
    assert 0 < ttl <= keys.OUTPUT_TTL_S
    assert exists == 0


def test_output_whose_logprobs_miss_its_token_is_refused_not_shortened():
    from pdserve.shared.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from pdserve.shared.worker.events import UnpublishableOutput, to_event

    c = CompletionOutput(0, "ab", [5, 6], logprobs=[{5: Logprob(-0.1, 1)}, {7: Logprob(-0.2, 1)}],
                         new_token_ids=[6])
    with pytest.raises(UnpublishableOutput, match="token 6"):
        to_event(RequestOutput("r", None, [1], [c], False), 1, False)


@pytest.mark.slow
def test_a_steps_output_is_unchanged_by_the_next_step():
    """The worker formats step k's output on its event loop while the engine thread already runs step k+1: the
    output must be a snapshot (it once shared the request's logprob list, so step k's token met step k+1's entry)."""
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.llm_engine import LLMEngine
    from pdserve.shared.protocol.sampling_params import SamplingParams
    from pdserve.shared.worker.events import to_event

    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype="float32"))
    engine.add_request("r", engine.tokenizer.encode("Count from one to twenty in words: one, two, three,"),
                       SamplingParams(temperature=0, max_tokens=8, logprobs=2))
    steps = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs:
            steps.append((outputs[0], to_event(outputs[0], 2, False)))  # formatted at once: the reference
    assert len(steps) == 8
    for out, at_once in steps:  # formatted after every later step has run
        late = to_event(out, 2, False)
        assert late.token_ids == at_once.token_ids and late.completion_tokens == at_once.completion_tokens
        assert [(lp.token_id, lp.logprob, lp.top) for lp in late.logprobs] == \
               [(lp.token_id, lp.logprob, lp.top) for lp in at_once.logprobs]
