"""A decode pod that is alive but slow to answer: its engine runs long steps on a loaded CPU, and
reserve and commit wait for the step. The client waits past ``request_timeout_s`` while ``peer_alive`` says the pod's
heartbeat is fresh, and gives up (``timed_out``, saying why) once it is not. Real TCP, a real transfer server."""

from __future__ import annotations

import asyncio

import pytest
from support.kv_pool import PoolReceiver

from pdserve.shared.transport import KVTransferClient, KVTransferError, KVTransferServer, Reserve

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

SECRET = "test-secret-0123456789"


class SlowReceiver(PoolReceiver):
    """Answers reserve after ``delay_s`` (a decode pod whose engine thread is busy with a long step)."""

    def __init__(self, layout, delay_s: float) -> None:
        super().__init__(layout)
        self.delay_s = delay_s

    async def reserve(self, msg):
        await asyncio.sleep(self.delay_s)
        return await super().reserve(msg)


async def reserve_on_slow_pod(layout, alive: bool):
    receiver = SlowReceiver(layout, delay_s=0.9)
    server = KVTransferServer(receiver, SECRET, host="127.0.0.1", port=0)
    await server.start()
    asked = []

    async def peer_alive(host: str, port: int) -> bool:
        asked.append((host, port))
        return alive

    client = KVTransferClient("127.0.0.1", server.port, layout, SECRET, request_timeout_s=0.3, peer_alive=peer_alive)
    try:
        await client.connect()
        try:
            return await client.reserve(Reserve("r", [1] * 20, 20, [], None)), asked, server.port
        except KVTransferError as exc:
            return exc, asked, server.port
    finally:
        await client.close()
        await server.stop()


async def test_a_live_busy_pod_is_waited_for(layout):
    reply, asked, port = await reserve_on_slow_pod(layout, alive=True)
    assert not isinstance(reply, Exception), reply
    assert reply.ok
    assert len(asked) >= 2 and set(asked) == {("127.0.0.1", port)}  # asked at each timeout, waited each time


async def test_a_pod_whose_heartbeat_stopped_fails_the_frame_with_a_reason(layout):
    exc, asked, port = await reserve_on_slow_pod(layout, alive=False)
    assert isinstance(exc, KVTransferError) and exc.timed_out and exc.unreachable
    assert str(exc) == f"127.0.0.1:{port} did not answer reserve within 0.3 s and its heartbeat stopped"
    assert len(asked) == 1


class GatedReceiver(PoolReceiver):
    """Holds request ``held``'s reserve until ``gate`` is set (its engine call waits for a long step)."""

    def __init__(self, layout, held: str) -> None:
        super().__init__(layout)
        self.held, self.gate = held, asyncio.Event()

    async def reserve(self, msg):
        if msg.request_id == self.held:
            await self.gate.wait()
        return await super().reserve(msg)


async def test_a_waiting_reserve_does_not_hold_up_other_requests_on_the_same_connection(layout):
    """Frames of different requests on one connection are served concurrently (so a burst of hand-overs reaches the
    decode engine together between two steps, not one per step); a duplicate reserve of a request whose reserve is
    still in flight is refused; and a reservation that completes after its connection dropped is released."""
    receiver = GatedReceiver(layout, held="a")
    server = KVTransferServer(receiver, SECRET, host="127.0.0.1", port=0)
    await server.start()
    client = KVTransferClient("127.0.0.1", server.port, layout, SECRET, request_timeout_s=10)
    try:
        await client.connect()
        first = asyncio.ensure_future(client.reserve(Reserve("a", [1] * 20, 20, [], None)))
        await asyncio.sleep(0.1)
        other = await asyncio.wait_for(client.reserve(Reserve("b", [2] * 20, 20, [], None)), 2.0)
        again = await asyncio.wait_for(client.reserve(Reserve("a", [1] * 20, 20, [], None)), 2.0)
        assert other.ok and not first.done()
        assert not again.ok and again.error == "request 'a' already holds a lease"
        receiver.gate.set()
        assert (await first).ok
        assert server.active_leases == 2

        receiver.held = "c"
        receiver.gate.clear()
        late = asyncio.ensure_future(client.reserve(Reserve("c", [3] * 20, 20, [], None)))
        await asyncio.sleep(0.1)
        await client.close()  # the peer leaves while "c" is being reserved
        late.cancel()
        receiver.gate.set()
        for _ in range(50):
            if server.active_leases == 0 and receiver.used_blocks == 0:
                break
            await asyncio.sleep(0.05)
        # a and b were released with the connection; c's blocks, reserved after it closed, at once
        assert (server.active_leases, receiver.used_blocks) == (0, 0)
    finally:
        await client.close()
        await server.stop()
