"""A strict reader of OpenAI-style SSE streams: the rule vLLM's serving benchmark applies.

Every non-empty line must be ``data: <json>`` or ``data: [DONE]``; anything else (an SSE comment such as
``: ping - <timestamp>``, an ``event:`` or ``id:`` field, data that is not JSON) raises ``SSEProtocolError``.
vLLM's benchmark json-decodes every non-empty line, so a stream that passes here passes there too. pdserve's
load generator and its tests read streams only through this module, so a server change that breaks the rule
fails loudly instead of being skipped over.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterable, Iterable, Iterator

DONE = "[DONE]"


class SSEProtocolError(ValueError):
    """A stream line that is neither ``data: <json>`` nor ``data: [DONE]``, or a stream without ``[DONE]``."""


def parse_line(line: str | bytes) -> dict[str, Any] | str | None:
    """One line of a stream: None for a blank line (the event separator), ``DONE`` for ``data: [DONE]``, else
    the decoded JSON object. Raises ``SSEProtocolError`` for anything else."""
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    if not line.startswith("data:"):
        raise SSEProtocolError(f"SSE line is not a data line: {line[:120]!r}")
    payload = line[5:].strip()
    if payload == DONE:
        return DONE
    try:
        data = json.loads(payload)
    except ValueError as exc:
        raise SSEProtocolError(f"SSE data is not JSON: {payload[:120]!r}") from exc
    if not isinstance(data, dict):
        raise SSEProtocolError(f"SSE data is not a JSON object: {payload[:120]!r}")
    return data


class StrictSSE:
    """Feeds lines one at a time; ``feed`` returns the chunk a data line carries (None otherwise) and raises on a
    line that breaks the rule, or on any line after ``[DONE]``."""

    def __init__(self) -> None:
        self.done = False

    def feed(self, line: str | bytes) -> dict[str, Any] | None:
        item = parse_line(line)
        if item is None:
            return None
        if self.done:
            raise SSEProtocolError(f"data after [DONE]: {str(line)[:120]!r}")
        if item == DONE:
            self.done = True
            return None
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Raise if the stream ended without ``data: [DONE]``."""
        if not self.done:
            raise SSEProtocolError("the stream ended without data: [DONE]")


def read_chunks(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a whole stream (e.g. ``httpx.Response.iter_lines()``), strictly; raises
    ``SSEProtocolError`` on a bad line or a missing ``[DONE]``."""
    sse = StrictSSE()
    for line in lines:
        chunk = sse.feed(line)
        if chunk is not None:
            yield chunk
    sse.close()


async def aread_chunks(lines: AsyncIterable[str | bytes]) -> Any:
    """``read_chunks`` for an async line iterator (``httpx``'s ``aiter_lines``, ``aiohttp``'s ``content``)."""
    sse = StrictSSE()
    async for line in lines:
        chunk = sse.feed(line)
        if chunk is not None:
            yield chunk
    sse.close()
