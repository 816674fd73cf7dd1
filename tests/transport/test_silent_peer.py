"""A KV port that accepts connections and never answers: the client gives up within its
timeout with a reason that says so (``TimeoutError()`` alone has an empty message), marked ``timed_out``."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.shared.transport.client import KVTransferClient, KVTransferError


def test_connect_to_a_port_that_never_answers_times_out_with_a_reason(layout):
    async def run():
        accepted = []

        async def silent(reader, writer):
            accepted.append(writer)  # hold it open, say nothing

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = KVTransferClient("127.0.0.1", port, layout, "s" * 32, connect_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(KVTransferError) as info:
            await client.connect()
        elapsed = time.monotonic() - started
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()
        return info.value, elapsed, len(accepted), port

    exc, elapsed, accepted, port = asyncio.run(run())
    assert accepted == 1
    assert 0.4 < elapsed < 5
    assert exc.timed_out and exc.unreachable
    assert str(exc).endswith(":%d accepted the connection but did not answer the KV-transfer handshake within 0.5 s"
                             % port)
