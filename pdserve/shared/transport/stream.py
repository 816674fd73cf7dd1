"""An asyncio TCP connection that receives a frame's payload straight into its final buffer.

asyncio's StreamReader copies every received byte twice more (into its buffer, then out as
``bytes``) in 256 KiB pieces. KV payloads are tens of MB, so :class:`FrameConnection` is a
``BufferedProtocol``: while a payload read is pending, the kernel's ``recv_into`` writes into the
payload's own ``bytearray``, as large as what the socket has, like a blocking ``recv_into`` loop.
It offers the reader and writer methods the frame codec uses (``readexactly``, ``readinto``,
``write``, ``drain``, ``close``, ``wait_closed``, ``get_extra_info``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

_STAGING = 256 * 1024
# Unconsumed bytes held before reading pauses (a peer cannot make us buffer more than this + one recv).
_HIGH_WATER = 4 * 1024 * 1024


class FrameConnection(asyncio.BufferedProtocol):
    def __init__(self, on_connect: Callable[[FrameConnection], Awaitable[None]] | None = None) -> None:
        self._on_connect = on_connect
        self.transport: asyncio.Transport | None = None
        self._staging = bytearray(_STAGING)
        self._buf = bytearray()
        self._target: memoryview | None = None
        self._target_pos = 0
        self._waiter: asyncio.Future | None = None
        self._eof = False
        self._reading_paused = False
        self._lost: BaseException | None = None
        self._closed: asyncio.Future | None = None
        self._write_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self.handler: asyncio.Task | None = None

    # ---------------------------------------------------------------------------------------
    # protocol callbacks (the event loop calls these)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        self._closed = loop.create_future()
        if self._on_connect is not None:
            self.handler = loop.create_task(self._on_connect(self))

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._target is not None:
            return self._target[self._target_pos:]
        return self._staging

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._target_pos += nbytes
            if self._target_pos == len(self._target):
                self._target = None
                self._wake()
            return
        self._buf += memoryview(self._staging)[:nbytes]
        self._wake()
        if len(self._buf) > _HIGH_WATER and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._eof = True
        self._lost = exc or ConnectionResetError("connection closed")
        self._wake()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("connection lost"))
            self._drain_waiter.exception()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # ---------------------------------------------------------------------------------------
    # reading (one reader at a time)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        assert self._waiter is None, "FrameConnection allows one reader at a time"
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _resume(self) -> None:
        if self._reading_paused and self.transport is not None and not self.transport.is_closing():
            self._reading_paused = False
            self.transport.resume_reading()

    async def readexactly(self, n: int) -> bytes:
        """``n`` bytes; raises ``asyncio.IncompleteReadError`` (with what came) at EOF."""
        while len(self._buf) < n:
            if self._eof:
                partial = bytes(self._buf)
                self._buf.clear()
                raise asyncio.IncompleteReadError(partial, n)
            self._resume()
            await self._wait()
        data = bytes(memoryview(self._buf)[:n])
        del self._buf[:n]
        if len(self._buf) <= _HIGH_WATER // 2:
            self._resume()
        return data

    async def readinto(self, view: memoryview) -> None:
        """Fills ``view`` exactly (the kernel writes into it directly); ``IncompleteReadError`` at EOF."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        take = min(len(self._buf), len(view))
        view[:take] = memoryview(self._buf)[:take]
        del self._buf[:take]
        if take == len(view):
            return
        self._target, self._target_pos = view, take
        try:
            while self._target is not None:
                if self._eof:
                    raise asyncio.IncompleteReadError(bytes(view[:self._target_pos]), len(view))
                self._resume()
                await self._wait()
        finally:
            self._target = None

    # ---------------------------------------------------------------------------------------
    # writing

    def write(self, data) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection closed")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._lost is not None:
            raise ConnectionResetError(f"connection lost: {self._lost}")
        if self._write_paused:
            self._drain_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await asyncio.shield(self._closed)

    def get_extra_info(self, name: str, default=None):
        return self.transport.get_extra_info(name, default) if self.transport is not None else default


async def open_frame_connection(host: str, port: int) -> FrameConnection:
    _, conn = await asyncio.get_running_loop().create_connection(FrameConnection, host, port)
    return conn


async def start_frame_server(on_connect: Callable[[FrameConnection], Awaitable[None]], host: str,
                             port: int) -> asyncio.base_events.Server:
    return await asyncio.get_running_loop().create_server(lambda: FrameConnection(on_connect), host, port)
