"""Delivering a job's output: the whole JSON body once every choice finished (``full_response``), or an SSE
stream of chunks (``stream_response``). Both end the job exactly once however the client leaves (``finish``:
completed, aborted with the error's type, or aborted because the client went away).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import anyio
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from . import errors
from .errors import OpenAIError
from .responses import encode_json

if TYPE_CHECKING:
    from .serving import CompletionService, Job

DISCONNECT_POLL_S = 0.25


class ClosingEventSource(EventSourceResponse):
    """An SSE response that runs ``on_close`` when it ends however it ends: a client that leaves before the
    first chunk cancels the response before the generator ever runs, so the generator's ``finally`` alone
    would miss the abort."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


async def full_response(service: CompletionService, job: Job,
                        is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> JSONResponse:
    """The OpenAI response body (200), 499 when ``is_disconnected`` says the client left first; a worker's or
    the relay's error is raised as ``OpenAIError`` after the job is aborted with its type."""

    async def collect() -> None:
        async for index, event in service.events(job):
            job.builder.on_event(index, event)

    async def disconnected() -> None:
        while is_disconnected is None or not await is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():
            await service.finish(job, aborted=True)
            return JSONResponse(errors.error_body(499, "Client disconnected"), status_code=499)
        try:
            collector.result()  # raises the worker's or the relay's error
        except OpenAIError as exc:
            await service.finish(job, aborted=True, reason=exc.type)
            raise
        service.record_finish(job)
        await service.finish(job, aborted=False)
        return JSONResponse(job.builder.response())
    finally:
        watcher.cancel()
        collector.cancel()
        await service.finish(job, aborted=True, reason="cancelled")  # no-op unless cancelled from outside


async def stream_chunks(service: CompletionService, job: Job) -> AsyncIterator[str]:
    """The SSE data lines: each chunk as JSON, the usage chunk when asked for, then ``[DONE]``; an error ends the
    stream with its OpenAI error body and ``[DONE]``. A consumer that stops early aborts the job."""
    complete = False
    try:
        try:
            async for index, event in service.events(job):
                for text in job.builder.stream_json(index, event):
                    yield text
        except OpenAIError as exc:
            await service.finish(job, aborted=True, reason=exc.type)
            complete = True
            yield encode_json(exc.body())
            yield "[DONE]"
            return
        if job.builder.include_usage:
            yield encode_json(job.builder.usage_chunk())
        complete = True
        service.record_finish(job)
        await service.finish(job, aborted=False)
        yield "[DONE]"
    finally:
        if not complete:
            await service.finish(job, aborted=True)


def stream_response(service: CompletionService, job: Job) -> EventSourceResponse:
    """``stream_chunks`` as ``text/event-stream``: only data lines unless keep-alive comments are asked for
    (``sse_ping_s``; see pdserve.loadtest.sse)."""
    return ClosingEventSource(stream_chunks(service, job), lambda: service.finish(job, aborted=True), sep="\n",
                              ping=service.settings.sse_ping_s)
