"""Engine outputs -> ``OutputEvent``s on the request's Redis output stream."""

from __future__ import annotations

from redis.exceptions import NoScriptError

from pdserve.shared.engine.outputs import RequestOutput
from pdserve.shared.protocol.messages import OutputEvent, TokenLogprob
from pdserve.shared.worker.output_writer import OutputWriter
from pdserve.shared.worker.redis_retry import retry_redis


class UnpublishableOutput(ValueError):
    """A step's output that cannot become a correct event (its logprobs do not match its tokens). The worker
    fails that request with an error event instead of publishing a wrong or shortened one."""


def to_event(out: RequestOutput, num_logprobs: int | None, first: bool) -> OutputEvent:
    """The step's delta of completion 0 as an event (the router fans n > 1 out into requests).

    ``out`` must be the engine's snapshot of the step (``LLMEngine.step``). With logprobs, each new token's
    ``TokenLogprob.top`` holds the ``num_logprobs`` most likely tokens plus the sampled one when it is not among
    them (as vLLM returns them). Raises ``UnpublishableOutput`` when a new token has no logprob entry of its own.
    """
    c = out.outputs[0]
    logprobs = None
    if num_logprobs is not None and c.logprobs is not None and c.new_token_ids:
        n_new = len(c.new_token_ids)
        if len(c.logprobs) < n_new:
            raise UnpublishableOutput(f"{n_new} new tokens but {len(c.logprobs)} logprob entries")
        logprobs = []
        for token_id, entry in zip(c.new_token_ids, c.logprobs[len(c.logprobs) - n_new:]):
            chosen = entry.get(token_id)
            if chosen is None:
                raise UnpublishableOutput(f"the logprob entry of token {token_id} (position "
                                          f"{len(c.token_ids) - n_new + len(logprobs)}) is not that token's")
            top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_logprobs),
                         key=lambda item: item[1].rank)
            pairs = [(t, lp.logprob) for t, lp in top]
            if num_logprobs and token_id not in {t for t, _ in pairs}:
                pairs.append((token_id, chosen.logprob))
            logprobs.append(TokenLogprob(token_id, chosen.logprob, pairs))
    return OutputEvent(
        request_id=out.request_id,
        token_ids=list(c.new_token_ids),
        text=c.new_text,
        finish_reason=c.finish_reason,
        logprobs=logprobs,
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(c.token_ids),
        stop_reason=c.stop_reason,
        first_token_time=out.metrics.get("first_token_time") if first else None,
        num_cached_tokens=out.num_cached_tokens,
        prompt_logprobs=prompt_logprobs_wire(out) if first else None,
    )


def prompt_logprobs_wire(out: RequestOutput) -> list | None:
    """``RequestOutput.prompt_logprobs`` in ``OutputEvent``'s form (None when not asked or not computed here)."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else [[t, lp.logprob, lp.rank] for t, lp in entry.items()]
            for entry in out.prompt_logprobs]


def error_event(request_id: str, message: str, code: int, type_: str = "ServiceUnavailableError",
                param: str | None = None) -> OutputEvent:
    """``param``: the request field a 400 is about (the router's OpenAI error body names it)."""
    error = {"message": message, "type": type_, "code": code}
    if param is not None:
        error["param"] = param
    return OutputEvent(request_id=request_id, error=error)


async def publish(writer: OutputWriter, redis, events: list[OutputEvent], retry_s: float = 60.0) -> None:
    """Write a step's events in one round trip: one ``OutputBatch`` XADD per router for the requests a router relays
    (``OutputWriter.route``), one script call per event for the others (which skips requests aborted meanwhile, so
    an aborted stream is never recreated, and refreshes the TTL).

    While Redis is unreachable (a restart) the write is retried with exponential backoff (0.1 s .. 2 s) for up to
    ``retry_s``; a retried batch may land twice, which the router drops by ``completion_tokens``. Raises the last
    Redis error after that.
    """
    if not events:
        return

    async def write() -> None:
        pipe = redis.pipeline(transaction=False)
        loose = writer.queue_batches(pipe, events)
        for event in loose:
            await writer.write(event, client=pipe)  # the asyncio script call queues onto the pipeline
        try:
            await pipe.execute()
        except NoScriptError:
            # A cluster pipeline (or a new primary) without the script yet: the pipeline's other commands ran, so
            # only the script calls go again (resending the relay batches would deliver their events twice).
            await writer.load(redis)
            pipe = redis.pipeline(transaction=False)
            for event in loose:
                await writer.write(event, client=pipe)
            await pipe.execute()

    await retry_redis(write, f"writing {len(events)} output events", retry_s)
