"""The ``loopback`` KV connector: sender and server in one process (tests), no TCP port.

The server registers under a made-up ``kv_port`` in this process; a sender "connecting" to it gets one end of a
``socket.socketpair()`` and the server the other, so the frames, handshake, HMAC and leases are the TCP
connector's own. Pods in other processes cannot reach it (ConnectionRefusedError).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Mapping
from typing import Any, ClassVar

from pdserve.shared.transport.client import KVTransferClient
from pdserve.shared.transport.connector import KVConnector, KVEndpoint
from pdserve.shared.transport.server import KVTransferServer
from pdserve.shared.transport.stream import FrameConnection

_SERVERS: dict[int, LoopbackKVTransferServer] = {}  # kv_port -> server, in this process
_PORTS = itertools.count(1)


class LoopbackKVTransferServer(KVTransferServer):
    async def start(self) -> None:
        """Registers in this process; ``port=0`` takes the next free number (read it from ``.port``)."""
        self._stopping = False
        if not self.port:
            self.port = next(p for p in _PORTS if p not in _SERVERS)
        if self.port in _SERVERS:
            raise OSError(f"loopback KV port {self.port} is taken in this process")
        _SERVERS[self.port] = self

    async def stop(self) -> None:
        _SERVERS.pop(self.port, None)
        await super().stop()

    async def accept(self, sock: socket.socket) -> None:
        await asyncio.get_running_loop().connect_accepted_socket(lambda: FrameConnection(self._on_connection), sock)


class LoopbackKVTransferClient(KVTransferClient):
    async def _open(self) -> FrameConnection:
        server = _SERVERS.get(self.port)
        if server is None or server._stopping:  # noqa: SLF001
            raise ConnectionRefusedError(f"no loopback KV server {self.port} in this process")
        mine, theirs = socket.socketpair()
        await server.accept(theirs)
        _, conn = await asyncio.get_running_loop().create_connection(FrameConnection, sock=mine)
        return conn


class LoopbackConnector(KVConnector):
    """In-process hand-overs for tests. Its endpoint is its own: ``{"loopback_id": n}``, the number its server is
    registered under in this process (not a port anything listens on)."""

    name: ClassVar[str] = "loopback"
    client_class = LoopbackKVTransferClient
    server_class = LoopbackKVTransferServer

    def endpoint_fields(self, server: KVTransferServer) -> dict[str, Any]:
        return {"loopback_id": server.port}

    def endpoint(self, host: str, fields: Mapping[str, Any] | int) -> KVEndpoint:
        if isinstance(fields, int):
            fields = {"loopback_id": fields}
        return KVEndpoint(host, self._port(fields, "loopback_id"))
