"""One authenticated KV-transfer connection per decode pod, reused across requests (prefill side)."""

from __future__ import annotations

import asyncio
import time

from pdserve.shared.transport.client import KVTransferClient, KVTransferError
from pdserve.shared.transport.layout import KVLayout


class KVClientPool:
    """``await pool.get(host, port)`` returns a connected :class:`KVTransferClient` for that decode
    pod, opening it (handshake included) on first use and again after it broke. Concurrent callers
    share one connection (the client multiplexes requests). Raises what ``connect()`` raises; a caller that
    waited while another one's connect to the same pod failed gets that failure at once (``KVTransferError``,
    ``timed_out``) instead of waiting out a second connect timeout."""

    def __init__(self, layout: KVLayout, secret: str | bytes, *,
                 client_class: type[KVTransferClient] = KVTransferClient, **client_kwargs: object) -> None:
        self.layout = layout
        self.client_class = client_class  # a KV connector's sender (pdserve/shared/transport/connector.py)
        self._secret = secret
        self._client_kwargs = client_kwargs
        self._clients: dict[tuple[str, int], KVTransferClient] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._failed: dict[tuple[str, int], tuple[float, str]] = {}  # last failed connect: (monotonic, why)
        # Totals over every connection this pool has had (for pdserve:kv_transfer_* metrics).
        self._retired_bytes = 0
        self._retired_seconds = 0.0

    async def get(self, host: str, port: int) -> KVTransferClient:
        key = (host, port)
        client = self._clients.get(key)
        if client is not None and client.connected:
            return client
        asked = time.monotonic()
        async with self._locks.setdefault(key, asyncio.Lock()):
            failed = self._failed.get(key)
            if failed is not None and failed[0] >= asked:  # it failed while we waited for the lock
                raise KVTransferError(failed[1], timed_out=True)
            client = self._clients.get(key)
            if client is not None and client.connected:
                return client
            if client is not None:
                await self._retire(key)
            client = self.client_class(host, port, self.layout, self._secret, **self._client_kwargs)  # type: ignore[arg-type]
            try:
                await client.connect()
            except (KVTransferError, OSError) as exc:
                self._failed[key] = (time.monotonic(), str(exc) or repr(exc))
                raise
            self._failed.pop(key, None)
            self._clients[key] = client
            return client

    async def discard(self, host: str, port: int) -> None:
        """Closes the connection to that pod (e.g. it left the registry)."""
        if (host, port) in self._clients:
            await self._retire((host, port))

    @property
    def bytes_sent(self) -> int:
        return self._retired_bytes + sum(c.bytes_sent for c in self._clients.values())

    @property
    def seconds(self) -> float:
        return self._retired_seconds + sum(c.seconds for c in self._clients.values())

    async def _retire(self, key: tuple[str, int]) -> None:
        client = self._clients.pop(key)
        self._retired_bytes += client.bytes_sent
        self._retired_seconds += client.seconds
        await client.close()

    async def close(self) -> None:
        for key in list(self._clients):
            await self._retire(key)
