"""The decode pod's KV-transfer server: handshake, leases, and one loop per connection."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from pdserve.shared.transport.frames import (
    Abort, AbortReply, Blocks, BlocksReply, Commit, CommitReply, Error, Frame, FrameError, FrameLimits, MalformedFrame,
    Reserve, ReserveReply, ShmBlocks, ShmProbe, ShmProbeReply, read_frame, write_frame,
)
from pdserve.shared.transport.handshake import HandshakeError, secret_bytes, server_handshake
from pdserve.shared.transport.receiver import KVReceiver
from pdserve.shared.transport.stream import FrameConnection, start_frame_server

log = logging.getLogger("pdserve.transport")


@dataclass(eq=False)
class _Lease:
    lease_id: str
    request_id: str
    conn: object
    timer: asyncio.TimerHandle | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: bool = False


@dataclass(eq=False)
class _Conn:
    peer: str
    writer: FrameConnection
    leases: dict[str, _Lease] = field(default_factory=dict)
    closed: bool = False  # the connection ended: a reservation finishing now has nobody to answer


class KVTransferServer:
    """Accepts KV transfers for one decode pod (asyncio TCP).

    Every connection first passes the handshake (same :class:`KVLayout`, same shared secret); then
    it sends ``Reserve``/``Blocks``/``Commit``/``Abort`` frames, each answered by a reply with the
    same frame id. A successful reserve opens a lease of ``lease_ttl_s`` seconds, renewed by every
    ``Blocks`` frame; ``commit`` closes it; expiry, ``Abort``, a failed receive/commit, or the
    connection dropping first calls ``receiver.release(request_id)``. A frame that breaks the
    protocol closes that connection only (its leases released); the server keeps serving.
    """

    def __init__(
        self, receiver: KVReceiver, secret: str | bytes, host: str = "0.0.0.0", port: int = 9000,
        lease_ttl_s: float = 30.0, *, limits: FrameLimits | None = None, handshake_timeout_s: float = 10.0,
    ) -> None:
        self.receiver = receiver
        self._secret = secret_bytes(secret)
        self.host = host
        self.port = port
        self.lease_ttl_s = lease_ttl_s
        self.limits = limits or FrameLimits()
        self.handshake_timeout_s = handshake_timeout_s
        self._server: asyncio.base_events.Server | None = None
        self._leases: dict[str, _Lease] = {}
        self._conns: set[asyncio.Task] = set()
        self._expiries: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()  # reserves, blocks and commits in flight
        self._reserving: set[str] = set()  # request ids whose reserve is in flight
        self._stopping = False
        self.connector_name = "tcp"  # the KV connector this server belongs to (connector.py sets it)
        # Counters the decode worker exports as metrics.
        self.bytes_received = 0
        self.blocks_received = 0
        self.connections_accepted = 0
        self.handshakes_refused = 0
        self.protocol_errors = 0
        self.leases_expired = 0

    @property
    def active_leases(self) -> int:
        return len(self._leases)

    async def start(self) -> None:
        """Binds and listens; ``port=0`` picks a free port (read it from ``.port`` afterwards)."""
        self._stopping = False
        self._server = await self._listen(self._on_connection)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("KV-transfer server listening on %s:%d (layout %s)", self.host, self.port,
                 self.receiver.layout)

    async def _listen(self, on_connect: Callable[[FrameConnection], Awaitable[None]]) -> asyncio.base_events.Server:
        return await start_frame_server(on_connect, self.host, self.port)

    async def stop(self) -> None:
        """Stops accepting, closes every connection and releases every open lease."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)  # let started commits finish
        for task in list(self._expiries):
            task.cancel()
        await asyncio.gather(*self._expiries, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> KVTransferServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---------------------------------------------------------------------------------------
    # connections

    async def _on_connection(self, conn_: FrameConnection) -> None:
        reader = writer = conn_
        if self._stopping:  # accepted in the instant stop() began
            conn_.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        addr = writer.get_extra_info("peername")
        conn = _Conn(peer=f"{addr[0]}:{addr[1]}" if addr else "?", writer=writer)
        self.connections_accepted += 1
        try:
            try:
                await asyncio.wait_for(
                    server_handshake(reader, writer, self.receiver.layout, self._secret, self.limits, conn.peer),
                    self.handshake_timeout_s,
                )
            except HandshakeError:
                self.handshakes_refused += 1
                return
            except (asyncio.TimeoutError, TimeoutError):
                self.handshakes_refused += 1
                log.warning("KV-transfer server refused peer %s: timeout: no handshake within %.0f s",
                            conn.peer, self.handshake_timeout_s)
                return
            await self._serve(conn, reader)
        except FrameError as e:
            self.protocol_errors += 1
            log.warning("KV-transfer connection from %s closed: %s: %s", conn.peer, type(e).__name__, e)
            try:
                await write_frame(writer, Error("protocol", str(e)))
            except (ConnectionError, OSError):
                pass
        except (ConnectionError, OSError) as e:
            log.info("KV-transfer connection from %s lost: %s", conn.peer, e)
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must cost one connection, not the pod
            log.exception("KV-transfer connection from %s failed", conn.peer)
        finally:
            conn.closed = True
            for lease in list(conn.leases.values()):
                async with lease.lock:
                    if not lease.done:
                        log.info("KV-transfer peer %s gone before commit of %s: releasing",
                                 conn.peer, lease.request_id)
                        await self._end(lease, release=True)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            self._conns.discard(task)

    async def _serve(self, conn: _Conn, reader: FrameConnection) -> None:
        while True:
            got = await read_frame(reader, self.limits)
            if got is None:
                return
            frame, frame_id = got
            if isinstance(frame, (Reserve, Blocks, ShmBlocks, Commit)):
                # Each waits for the receiver's engine (up to a step): the frames of other requests on this
                # connection need not wait behind it, so many requests' reserves, blocks and commits reach the engine
                # together between two steps instead of one per step (a burst of 32 hand-overs took ~3 decode steps
                # each). A request's own frames stay in order: its client awaits each reply before the next frame
                # (its blocks frames, sent together, take the lease's FIFO lock in the order read).
                task = asyncio.get_running_loop().create_task(self._reply_later(conn, frame, frame_id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                await asyncio.sleep(0)  # it takes the lease's lock (FIFO) before we read the next frame
                continue
            reply = await self._dispatch(conn, frame)
            await write_frame(conn.writer, reply, frame_id)

    async def _reply_later(self, conn: _Conn, frame: Reserve | Blocks | ShmBlocks | Commit, frame_id: int) -> None:
        try:
            reply = await (self._commit(conn, frame) if isinstance(frame, Commit) else self._dispatch(conn, frame))
        except Exception:  # a bug must cost this connection (its peer sees it drop, its leases are released), not hang it
            log.exception("KV-transfer %s of %s from %s failed", frame.TYPE, frame.request_id, conn.peer)
            conn.writer.close()
            return
        try:
            await write_frame(conn.writer, reply, frame_id)
        except (ConnectionError, OSError) as e:
            log.warning("KV-transfer peer %s gone before the reply to %s of %s (ok=%s): %s",
                        conn.peer, frame.TYPE, frame.request_id, reply.ok, e)

    async def _dispatch(self, conn: _Conn, frame: Frame) -> Frame:
        if isinstance(frame, Reserve):
            return await self._reserve(conn, frame)
        if isinstance(frame, (Blocks, ShmBlocks)):
            return await self._blocks(conn, frame)
        if isinstance(frame, Abort):
            return await self._abort(conn, frame)
        if isinstance(frame, ShmProbe):
            return self.shm_probe(frame)
        raise MalformedFrame(f"unexpected {frame.TYPE} frame after the handshake")

    # ---------------------------------------------------------------------------------------
    # requests

    async def _reserve(self, conn: _Conn, msg: Reserve) -> ReserveReply:
        if msg.request_id in self._leases or msg.request_id in self._reserving:
            return ReserveReply(ok=False, error=f"request {msg.request_id!r} already holds a lease")
        self._reserving.add(msg.request_id)  # reserves run concurrently: one per request at a time
        try:
            reply = await self.receiver.reserve(msg)
        except Exception as e:
            log.exception("receiver.reserve(%s) failed", msg.request_id)
            return ReserveReply(ok=False, error=f"reserve failed: {type(e).__name__}: {e}")
        finally:
            self._reserving.discard(msg.request_id)
        if not reply.ok:
            return reply
        if conn.closed:  # the peer left while we reserved: nobody will send blocks or commit
            try:
                await self.receiver.release(msg.request_id)
            except Exception:
                log.exception("receiver.release(%s) failed", msg.request_id)
            return ReserveReply(ok=False, error="connection closed")
        lease = _Lease(lease_id=uuid.uuid4().hex, request_id=msg.request_id, conn=conn)
        self._leases[msg.request_id] = lease
        conn.leases[msg.request_id] = lease
        self._arm(lease)
        reply.lease_id, reply.lease_ttl_s = lease.lease_id, self.lease_ttl_s
        return reply

    def shm_probe(self, msg: ShmProbe) -> ShmProbeReply:
        """A ``shm`` sender's same-host check; this server (``tcp``, ``loopback``) takes no shared memory."""
        return ShmProbeReply(ok=False, error=f"this decode pod's kv_connector is {self.connector_name!r}, not 'shm'")

    def blocks_tensor(self, msg: Blocks | ShmBlocks) -> torch.Tensor:
        """The frame's blocks as a tensor: ``Blocks`` carries them; ``ShmBlocks`` only with the ``shm`` connector."""
        if isinstance(msg, ShmBlocks):
            raise ValueError(f"this decode pod's kv_connector is {self.connector_name!r}: it takes no shared memory")
        return msg.to_tensor()

    async def _blocks(self, conn: _Conn, msg: Blocks | ShmBlocks) -> BlocksReply:
        lease = conn.leases.get(msg.request_id)
        if lease is None:
            return BlocksReply(ok=False, error=self._no_lease(msg.request_id))
        layout = self.receiver.layout
        async with lease.lock:
            if lease.done:
                return BlocksReply(ok=False, error=self._no_lease(msg.request_id))
            if msg.dtype != layout.dtype or tuple(msg.shape[1:]) != layout.block_shape:
                await self._end(lease, release=True)
                return BlocksReply(ok=False, error=(
                    f"blocks of dtype {msg.dtype} shape {msg.shape} do not match the layout "
                    f"(dtype {layout.dtype}, [n, {', '.join(map(str, layout.block_shape))}])"))
            self._arm(lease)
            try:
                blocks = self.blocks_tensor(msg)
                await self.receiver.receive_blocks(msg.request_id, msg.first_block_index, blocks)
            except Exception as e:
                log.warning("receiver.receive_blocks(%s) failed: %s", msg.request_id, e)
                await self._end(lease, release=True)
                return BlocksReply(ok=False, error=f"receive_blocks failed: {type(e).__name__}: {e}")
            self.bytes_received += blocks.numel() * blocks.element_size()
            self.blocks_received += msg.shape[0]
        return BlocksReply(ok=True)

    async def _commit(self, conn: _Conn, msg: Commit) -> CommitReply:
        lease = conn.leases.get(msg.request_id)
        if lease is None:
            return CommitReply(ok=False, error=self._no_lease(msg.request_id))
        async with lease.lock:
            if lease.done:
                return CommitReply(ok=False, error=self._no_lease(msg.request_id))
            try:
                reply = await self.receiver.commit(msg)
            except Exception as e:
                log.exception("receiver.commit(%s) failed", msg.request_id)
                reply = CommitReply(ok=False, error=f"commit failed: {type(e).__name__}: {e}")
            await self._end(lease, release=not reply.ok)
        return reply

    async def _abort(self, conn: _Conn, msg: Abort) -> AbortReply:
        lease = conn.leases.get(msg.request_id)
        if lease is None:
            return AbortReply(ok=False, error=self._no_lease(msg.request_id))
        async with lease.lock:
            if not lease.done:
                await self._end(lease, release=True)
        return AbortReply(ok=True)

    @staticmethod
    def _no_lease(request_id: str) -> str:
        return f"no lease for request {request_id!r} on this connection (expired, aborted or never reserved)"

    # ---------------------------------------------------------------------------------------
    # leases

    def _arm(self, lease: _Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        lease.timer = asyncio.get_running_loop().call_later(self.lease_ttl_s, self._on_expiry, lease)

    def _on_expiry(self, lease: _Lease) -> None:
        task = asyncio.get_running_loop().create_task(self._expire(lease))
        self._expiries.add(task)
        task.add_done_callback(self._expiries.discard)

    async def _expire(self, lease: _Lease) -> None:
        async with lease.lock:
            if lease.done:
                return
            self.leases_expired += 1
            log.warning("KV-transfer lease %s of request %s expired after %.1f s: releasing",
                        lease.lease_id, lease.request_id, self.lease_ttl_s)
            await self._end(lease, release=True)

    async def _end(self, lease: _Lease, release: bool) -> None:
        """Closes a lease (caller holds ``lease.lock``), releasing the request's blocks if asked."""
        lease.done = True
        if lease.timer is not None:
            lease.timer.cancel()
        if self._leases.get(lease.request_id) is lease:
            del self._leases[lease.request_id]
        lease.conn.leases.pop(lease.request_id, None)  # type: ignore[attr-defined]
        if release:
            try:
                await self.receiver.release(lease.request_id)
            except Exception:
                log.exception("receiver.release(%s) failed", lease.request_id)
