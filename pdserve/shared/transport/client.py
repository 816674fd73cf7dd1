"""The prefill pod's side of a KV transfer: one authenticated connection to one decode pod."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from pdserve.shared.transport.frames import (
    Abort, AbortReply, Blocks, BlocksReply, Commit, CommitReply, Error, Frame, FrameError, FrameLimits,
    Reserve, ReserveReply, read_frame, write_frame,
)
from pdserve.shared.transport.handshake import client_handshake, secret_bytes
from pdserve.shared.transport.layout import KVLayout
from pdserve.shared.transport.stream import FrameConnection, open_frame_connection

log = logging.getLogger("pdserve.transport")


class KVTransferError(Exception):
    """A transfer failed: the decode pod rejected it, the connection broke (``.connection_lost``), or the pod
    did not answer a frame in time (``.timed_out``). Either of the last two means the pod is unreachable."""

    def __init__(self, message: str, connection_lost: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.connection_lost = connection_lost
        self.timed_out = timed_out

    @property
    def unreachable(self) -> bool:
        return self.connection_lost or self.timed_out


class KVTransferClient:
    """Sends requests' KV blocks to one decode pod's :class:`KVTransferServer`.

    ``connect()`` runs the handshake (raises :class:`HandshakeError` when refused). Requests may run
    concurrently on one connection: each frame carries an id and its reply is matched by that id.
    A typical transfer::

        reply = await client.reserve(Reserve(rid, prompt, len(prompt), hashes, salt))
        await client.send_blocks(rid, reply.num_cached_blocks, kv[reply.num_cached_blocks:])
        await client.commit(Commit(rid, first_token, params, prompt, arrival_time))

    ``bytes_sent`` (KV payload bytes) and ``seconds`` (time spent in ``send_blocks``) accumulate
    over the connection's life.

    A frame unanswered for ``request_timeout_s`` fails (``timed_out``) unless ``peer_alive(host, port)`` says the
    pod is still alive (its registry heartbeat is fresh): a live pod whose engine is busy (a long step on a loaded
    CPU: reserve and commit run between its steps) is waited for, another ``request_timeout_s`` at a time.
    """

    def __init__(
        self, host: str, port: int, layout: KVLayout, secret: str | bytes, *,
        connect_timeout_s: float = 10.0, request_timeout_s: float = 60.0, limits: FrameLimits | None = None,
        peer_alive: Callable[[str, int], Awaitable[bool]] | None = None,
    ) -> None:
        self.host, self.port, self.layout = host, port, layout
        self._secret = secret_bytes(secret)
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.peer_alive = peer_alive
        self.limits = limits or FrameLimits()
        self._reader: FrameConnection | None = None
        self._writer: FrameConnection | None = None
        self._reader_task: asyncio.Task | None = None
        self._write_lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._closed_reason: str | None = None
        self._peer_max_payload = self.limits.max_payload_bytes
        self.bytes_sent = 0
        self.seconds = 0.0

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connected(self) -> bool:
        return self._writer is not None and self._closed_reason is None

    async def connect(self) -> None:
        """Opens the connection and runs the handshake, each within ``connect_timeout_s``. Raises
        ``HandshakeError``, ``OSError``, or :class:`KVTransferError` (``timed_out``) when the peer does not
        accept or does not answer the handshake in time (a port that accepts and then never answers)."""
        try:
            conn = await asyncio.wait_for(self._open(), self.connect_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise KVTransferError(f"{self.peer} did not accept a connection within {self.connect_timeout_s:g} s",
                                  timed_out=True) from None
        reader = writer = conn
        try:
            peer_max = await asyncio.wait_for(
                client_handshake(reader, writer, self.layout, self._secret, self.limits, self.peer),
                self.connect_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            writer.close()
            raise KVTransferError(f"{self.peer} accepted the connection but did not answer the KV-transfer "
                                  f"handshake within {self.connect_timeout_s:g} s", timed_out=True) from None
        except BaseException:
            writer.close()
            raise
        self._peer_max_payload = min(self.limits.max_payload_bytes, peer_max)
        self._reader, self._writer, self._closed_reason = reader, writer, None
        self._reader_task = asyncio.get_running_loop().create_task(self._read_replies())

    async def _open(self) -> FrameConnection:
        """The connection the frames travel on (a connector's client may open another kind)."""
        return await open_frame_connection(self.host, self.port)

    async def close(self) -> None:
        self._fail_pending("connection closed by the client")
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
            self._reader_task = None
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
            self._writer = None

    async def __aenter__(self) -> KVTransferClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------------------------------

    async def reserve(self, msg: Reserve) -> ReserveReply:
        """Reserves blocks for ``msg.request_id``; ``ok=False`` (with ``error``) when the pod can't."""
        return await self._call(msg, ReserveReply)

    async def send_blocks(self, request_id: str, first_block_index: int, blocks: torch.Tensor) -> int:
        """Sends ``blocks`` (``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``, the layout's
        dtype, any device) as the request's blocks from ``first_block_index`` on, in as many frames as
        the peers' payload limits need. Returns the bytes sent; raises :class:`KVTransferError` if
        the pod rejects them."""
        if blocks.dtype != self.layout.torch_dtype or tuple(blocks.shape[1:]) != self.layout.block_shape:
            raise ValueError(f"blocks must be [n, {', '.join(map(str, self.layout.block_shape))}] "
                             f"{self.layout.dtype}, got {list(blocks.shape)} {blocks.dtype}")
        if blocks.shape[0] == 0:
            return 0
        per_frame = self._peer_max_payload // self.layout.block_nbytes
        if per_frame < 1:
            raise ValueError(f"one block ({self.layout.block_nbytes} bytes) exceeds the payload limit")
        start = time.perf_counter()
        futures = []
        try:
            for i in range(0, blocks.shape[0], per_frame):
                frame = Blocks.from_tensor(request_id, first_block_index + i, blocks[i:i + per_frame])
                futures.append(await self._send(frame))
            replies = await self._answer(asyncio.gather(*futures), f"blocks of {request_id}", "acknowledge")
        finally:
            for f in futures:
                if not f.done():
                    f.cancel()
            self.seconds += time.perf_counter() - start
        for reply in replies:
            self._expect_type(reply, BlocksReply)
            if not reply.ok:
                raise KVTransferError(f"{self.peer} rejected blocks of {request_id}: {reply.error}")
        sent = blocks.numel() * blocks.element_size()
        self.bytes_sent += sent
        return sent

    async def commit(self, msg: Commit) -> CommitReply:
        """Hands the request over; ``ok=True`` once it joined the decode pod's batch."""
        return await self._call(msg, CommitReply)

    async def abort(self, request_id: str) -> bool:
        """Gives up the request's lease (the pod releases its blocks); ``False`` if it held none."""
        reply = await self._call(Abort(request_id), AbortReply)
        return reply.ok

    # ---------------------------------------------------------------------------------------

    async def _call(self, frame: Frame, reply_type: type):
        fut = await self._send(frame)
        return self._expect_type(await self._answer(fut, frame.TYPE), reply_type)

    async def _answer(self, fut: asyncio.Future, what: str, verb: str = "answer"):
        """``fut``'s result. Past each ``request_timeout_s`` without it, ``peer_alive`` decides: a live pod is waited
        for again, otherwise (or with no ``peer_alive``) :class:`KVTransferError` (``timed_out``). ``fut`` is
        cancelled when it is given up."""
        waited = 0.0
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=self.request_timeout_s)
                if done:
                    return fut.result()
                waited += self.request_timeout_s
                if self.peer_alive is None or not await self.peer_alive(self.host, self.port):
                    stale = " and its heartbeat stopped" if self.peer_alive is not None else ""
                    raise KVTransferError(f"{self.peer} did not {verb} {what} within {waited:g} s{stale}",
                                          timed_out=True)
                log.info("KV-transfer peer %s has not answered %s for %g s; its heartbeat is fresh: waiting",
                         self.peer, what, waited)
        finally:
            if not fut.done():
                fut.cancel()

    def _expect_type(self, reply: Frame, reply_type: type):
        if not isinstance(reply, reply_type):
            raise KVTransferError(f"{self.peer} answered with {reply.TYPE}, expected {reply_type.TYPE}")
        return reply

    async def _send(self, frame: Frame) -> asyncio.Future:
        if not self.connected:
            raise KVTransferError(f"not connected to {self.peer}: {self._closed_reason or 'call connect()'}",
                                  connection_lost=True)
        frame_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[frame_id] = fut
        try:
            async with self._write_lock:
                assert self._writer is not None
                await write_frame(self._writer, frame, frame_id)
        except (ConnectionError, OSError) as e:
            self._pending.pop(frame_id, None)
            fut.cancel()
            self._fail_pending(f"write failed: {e}")
            raise KVTransferError(f"connection to {self.peer} lost: {e}", connection_lost=True) from None
        except BaseException:
            self._pending.pop(frame_id, None)
            fut.cancel()
            raise
        return fut

    async def _read_replies(self) -> None:
        assert self._reader is not None
        reason = "connection closed by the server"
        try:
            while True:
                got = await read_frame(self._reader, self.limits)
                if got is None:
                    break
                frame, frame_id = got
                if isinstance(frame, Error):
                    reason = f"server closed the connection: {frame.code}: {frame.message}"
                    log.warning("KV-transfer server %s: %s", self.peer, reason)
                    break
                fut = self._pending.pop(frame_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(frame)
        except FrameError as e:
            reason = f"bad frame from the server: {e}"
            log.warning("KV-transfer server %s sent a bad frame: %s", self.peer, e)
        except (ConnectionError, OSError) as e:
            reason = f"connection lost: {e}"
        finally:
            self._fail_pending(reason)
            if self._writer is not None:
                self._writer.close()

    def _fail_pending(self, reason: str) -> None:
        self._closed_reason = self._closed_reason or reason
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(KVTransferError(f"{self.peer}: {reason}", connection_lost=True))
                fut.exception()  # awaiting callers still get it; unawaited ones (cancelled sends) stay quiet
