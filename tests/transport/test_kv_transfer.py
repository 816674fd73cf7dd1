"""KV transfer over real TCP on 127.0.0.1, into a real torch tensor pool (support/kv_pool.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct
import time

import pytest
import torch
from support.kv_pool import PoolReceiver

from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.transport import (
    Commit, FrameLimits, HandshakeError, KVClientPool, KVLayout, KVTransferClient, KVTransferError, KVTransferServer, Reserve,
)
from pdserve.shared.transport.frames import Auth, Blocks, Error, Hello, encode_frame, read_frame, write_frame

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

SECRET = "test-secret-0123456789"


def random_blocks(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN payloads, infinities, subnormals included): only a bit-exact copy passes."""
    g = torch.Generator().manual_seed(seed)
    nbytes = n * layout.block_nbytes
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(layout.torch_dtype).reshape(n, *layout.block_shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


async def started(receiver: PoolReceiver, **kw) -> KVTransferServer:
    server = KVTransferServer(receiver, SECRET, host="127.0.0.1", port=0, **kw)
    await server.start()
    return server


async def eventually(predicate, timeout_s: float = 10.0) -> None:
    """Waits for something the other end of a socket does after we already returned."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def commit_msg(rid: str, prompt: list[int]) -> Commit:
    return Commit(request_id=rid, first_token_id=42, sampling_params=SamplingParams(temperature=0.0, max_tokens=8),
                  prompt_token_ids=prompt, arrival_time=1_700_000_000.5, deadline=None,
                  first_token_time=1_700_000_001.25)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_blocks_arrive_bit_exact_and_commit_closes_the_lease(layout, dtype):
    layout = dataclasses.replace(layout, dtype=dtype)
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    # A client payload limit of 2 blocks forces send_blocks to split into several frames.
    client = KVTransferClient("127.0.0.1", server.port, layout, SECRET,
                              limits=FrameLimits(max_payload_bytes=2 * layout.block_nbytes))
    try:
        await client.connect()
        prompt = list(range(100, 177))  # 77 tokens: 5 blocks, the last one partial
        kv = random_blocks(layout, 5)
        reply = await client.reserve(Reserve("req-1", prompt, len(prompt), [], None))
        assert reply.ok and reply.lease_id and reply.lease_ttl_s == server.lease_ttl_s
        assert server.active_leases == 1
        await client.send_blocks("req-1", 0, kv[:3])
        await client.send_blocks("req-1", 3, kv[3:])
        done = await client.commit(commit_msg("req-1", prompt))
        assert done.ok and done.error is None
        assert same_bits(receiver.blocks_of("req-1"), kv)
        assert receiver.committed["req-1"] == commit_msg("req-1", prompt)
        assert server.active_leases == 0 and receiver.released == []
        assert client.bytes_sent == server.bytes_received == 5 * layout.block_nbytes
        assert server.blocks_received == 5
    finally:
        await client.close()
        await server.stop()


async def test_concurrent_requests_on_one_connection_get_their_own_replies(layout):
    receiver = PoolReceiver(layout, num_blocks=8)
    server = await started(receiver)
    try:
        async with KVTransferClient("127.0.0.1", server.port, layout, SECRET) as client:
            # 5 + 5 blocks cannot both fit into 8: exactly one of the two reserves is refused.
            replies = await asyncio.gather(*[
                client.reserve(Reserve(f"r{i}", [1] * 80, 80, [], None)) for i in range(2)])
            assert sorted(r.ok for r in replies) == [False, True]
            refused = next(r for r in replies if not r.ok)
            assert refused.error == "out of KV blocks: need 5, 3 free"
            winner = f"r{[r.ok for r in replies].index(True)}"
            kv = random_blocks(layout, 5, seed=1)
            await asyncio.gather(client.send_blocks(winner, 0, kv[:2]), client.send_blocks(winner, 2, kv[2:]))
            assert same_bits(receiver.blocks_of(winner), kv)
    finally:
        await server.stop()


async def test_a_receiver_error_is_reported_and_releases_the_request(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    try:
        async with KVTransferClient("127.0.0.1", server.port, layout, SECRET) as client:
            await client.reserve(Reserve("r", [1] * 20, 20, [], None))  # 2 blocks
            with pytest.raises(KVTransferError, match="blocks 0..2 are beyond the 2 reserved"):
                await client.send_blocks("r", 0, random_blocks(layout, 3))
            assert receiver.released == ["r"] and receiver.used_blocks == 0
            # The request is gone; the connection is still good for the next one.
            reply = await client.commit(commit_msg("r", [1] * 20))
            assert not reply.ok and "no lease for request 'r'" in reply.error
            assert (await client.reserve(Reserve("r2", [1] * 20, 20, [], None))).ok
    finally:
        await server.stop()


async def test_abort_releases_the_blocks(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    try:
        async with KVTransferClient("127.0.0.1", server.port, layout, SECRET) as client:
            await client.reserve(Reserve("r", [1] * 40, 40, [], None))
            assert receiver.used_blocks == 3
            assert await client.abort("r") is True
            assert receiver.released == ["r"] and receiver.used_blocks == 0 and server.active_leases == 0
            assert await client.abort("r") is False
    finally:
        await server.stop()


async def test_lease_expiry_calls_release(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver, lease_ttl_s=0.2)
    try:
        async with KVTransferClient("127.0.0.1", server.port, layout, SECRET) as client:
            await client.reserve(Reserve("slow", [1] * 40, 40, [], None))
            await asyncio.wait_for(receiver.released_event.wait(), 10)
            assert receiver.released == ["slow"] and receiver.used_blocks == 0
            assert server.active_leases == 0 and server.leases_expired == 1
            with pytest.raises(KVTransferError, match="no lease for request 'slow'"):
                await client.send_blocks("slow", 0, random_blocks(layout, 1))
    finally:
        await server.stop()


async def raw_handshake(port: int, layout: KVLayout, secret: str = SECRET):
    """A hand-driven client: returns the authenticated (reader, writer)."""
    from pdserve.shared.transport.handshake import client_handshake
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await client_handshake(reader, writer, layout, secret, FrameLimits(), "test")
    return reader, writer


async def test_a_client_dying_mid_transfer_releases_its_blocks(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    try:
        reader, writer = await raw_handshake(server.port, layout)
        await write_frame(writer, Reserve("doomed", [1] * 40, 40, [], None), 1)
        reply, _ = await read_frame(reader, FrameLimits())
        assert reply.ok and receiver.used_blocks == 3
        # Half a Blocks frame, then the process "dies" (RST, no FIN handshake).
        bufs = encode_frame(Blocks.from_tensor("doomed", 0, random_blocks(layout, 3)), 2)
        writer.write(bufs[0])
        writer.write(memoryview(bufs[1]).cast("B")[: layout.block_nbytes])
        await writer.drain()
        writer.transport.abort()
        await asyncio.wait_for(receiver.released_event.wait(), 10)
        assert receiver.released == ["doomed"] and receiver.used_blocks == 0 and server.active_leases == 0
    finally:
        await server.stop()


@pytest.mark.parametrize(("change", "expected"), [
    ({"block_size": 32}, "layout_mismatch: KV layout mismatch: block_size server 16 != client 32"),
    ({"dtype": "bfloat16"}, "layout_mismatch: KV layout mismatch: dtype server 'float32' != client 'bfloat16'"),
    ({"num_kv_heads": 9}, "layout_mismatch: KV layout mismatch: num_kv_heads server 3 != client 9"),
    # tensor parallelism: ranks that do not hold every KV head between them cannot be mapped
    ({"tensor_parallel_size": 2, "kv_head_ranges": ((0, 1), (1, 1))},
     "layout_mismatch: KV layout mismatch: client (tensor_parallel_size 2): KV head ranges [[0, 1], [1, 1]] do not "
     "cover the 3 KV heads exactly"),
    ({"tensor_parallel_size": 3, "kv_head_ranges": ((0, 1), (1, 1))},
     "layout_mismatch: KV layout mismatch: client (tensor_parallel_size 3): 2 KV head ranges for "
     "tensor_parallel_size 3"),
])
async def test_handshake_refuses_another_layout(layout, change, expected, caplog):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    caplog.set_level(logging.WARNING, logger="pdserve.transport")
    try:
        client = KVTransferClient("127.0.0.1", server.port, dataclasses.replace(layout, **change), SECRET)
        with pytest.raises(HandshakeError) as info:
            await client.connect()
        assert str(info.value) == expected
        await eventually(lambda: server.handshakes_refused == 1)
        logs = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("KV-transfer server refused peer 127.0.0.1:") and m.endswith(expected)
                   for m in logs), logs
        assert any(m.startswith(f"KV-transfer client was refused by peer 127.0.0.1:{server.port}: ")
                   and m.endswith(expected) for m in logs), logs
        assert server.handshakes_refused == 1
    finally:
        await server.stop()


async def test_pods_of_different_tensor_parallel_sizes_exchange_full_head_blocks(layout):
    # a TP=1 prefill pod and a TP=3 decode pod (and the reverse): blocks carry every KV head, each end splits them
    tp3 = dataclasses.replace(layout, tensor_parallel_size=3, kv_head_ranges=((0, 1), (1, 1), (2, 1)))
    for server_layout, client_layout in ((tp3, layout), (layout, tp3)):
        receiver = PoolReceiver(server_layout)
        server = await started(receiver)
        try:
            async with KVTransferClient("127.0.0.1", server.port, client_layout, SECRET) as client:
                assert (await client.reserve(Reserve("r", [1] * 32, 32, [], None))).ok
                kv = random_blocks(layout, 2)
                await client.send_blocks("r", 0, kv)
                assert same_bits(receiver.blocks_of("r"), kv)
        finally:
            await server.stop()


async def test_handshake_refuses_another_secret_on_both_sides(layout, caplog):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    caplog.set_level(logging.WARNING, logger="pdserve.transport")
    expected = "auth_failed: server failed the shared-secret challenge (PDSERVE_KV_TRANSFER_SECRET differs)"
    try:
        client = KVTransferClient("127.0.0.1", server.port, layout, "another-secret")
        with pytest.raises(HandshakeError) as info:
            await client.connect()
        assert str(info.value) == expected and info.value.code == "auth_failed"
        await eventually(lambda: server.handshakes_refused == 1)
        logs = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("KV-transfer client refused peer") and m.endswith(expected) for m in logs), logs
        assert any(m.startswith("KV-transfer server was refused by peer") and m.endswith(expected)
                   for m in logs), logs
        assert receiver.used_blocks == 0 and server.handshakes_refused == 1
    finally:
        await server.stop()


async def test_server_refuses_a_client_that_cannot_prove_the_secret(layout, caplog):
    """A foreign peer that skips verifying the server and forges its own proof gets auth_failed."""
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    caplog.set_level(logging.WARNING, logger="pdserve.transport")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        await write_frame(writer, Hello(1, layout.to_dict(), b"n" * 32, 1 << 20))
        hello, _ = await read_frame(reader, FrameLimits())
        assert isinstance(hello, Hello) and len(hello.mac) == 32
        await write_frame(writer, Auth(b"\x00" * 32))
        refusal, _ = await read_frame(reader, FrameLimits())
        assert refusal == Error("auth_failed",
                                "client failed the shared-secret challenge (PDSERVE_KV_TRANSFER_SECRET differs)")
        assert await read_frame(reader, FrameLimits()) is None  # closed
        await eventually(lambda: server.handshakes_refused == 1)
        assert any("server refused peer" in r.getMessage() and "auth_failed" in r.getMessage()
                   for r in caplog.records)
        # Nothing after a refused handshake reaches the receiver.
        assert receiver.tables == {}
        writer.close()
    finally:
        await server.stop()


async def test_a_bad_connection_does_not_disturb_the_others(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver, limits=FrameLimits(max_header_bytes=4096, max_payload_bytes=1 << 20))
    try:
        good = KVTransferClient("127.0.0.1", server.port, layout, SECRET)
        await good.connect()
        await good.reserve(Reserve("keep", [1] * 16, 16, [], None))

        # 1. garbage before any handshake
        r1, w1 = await asyncio.open_connection("127.0.0.1", server.port)
        w1.write(b"\x00\x00\x00\x05hello")
        frame, _ = await read_frame(r1, FrameLimits())
        assert isinstance(frame, Error) and frame.code == "protocol"
        assert await read_frame(r1, FrameLimits()) is None
        # 2. an authenticated peer declaring a 4 GiB header
        r2, w2 = await raw_handshake(server.port, layout)
        w2.write(b"\xff\xff\xff\xff")
        frame, _ = await read_frame(r2, FrameLimits())
        assert frame == Error("protocol", "header of 4294967295 bytes exceeds the limit of 4096")
        # 3. an authenticated peer whose lease dies with its connection
        r3, w3 = await raw_handshake(server.port, layout)
        await write_frame(w3, Reserve("victim", [1] * 16, 16, [], None), 7)
        assert (await read_frame(r3, FrameLimits()))[0].ok
        await write_frame(w3, Hello(1, layout.to_dict(), b"n" * 32, 1), 8)  # not allowed after handshake
        frame, _ = await read_frame(r3, FrameLimits())
        assert frame == Error("protocol", "unexpected hello frame after the handshake")
        await asyncio.wait_for(receiver.released_event.wait(), 10)
        assert receiver.released == ["victim"]
        for w in (w1, w2, w3):
            w.close()

        kv = random_blocks(layout, 1, seed=3)
        await good.send_blocks("keep", 0, kv)
        assert (await good.commit(commit_msg("keep", [1] * 16))).ok
        assert same_bits(receiver.blocks_of("keep"), kv)
        assert server.protocol_errors == 3
        await good.close()
    finally:
        await server.stop()


async def test_send_blocks_checks_the_layout_before_sending(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    try:
        async with KVTransferClient("127.0.0.1", server.port, layout, SECRET) as client:
            with pytest.raises(ValueError, match=r"blocks must be \[n, 2, 2, 16, 3, 8\] float32"):
                await client.send_blocks("r", 0, torch.zeros(1, 2, 2, 8, 3, 8))
            assert client.bytes_sent == 0
    finally:
        await server.stop()


async def test_server_stop_releases_open_leases(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    client = KVTransferClient("127.0.0.1", server.port, layout, SECRET)
    await client.connect()
    await client.reserve(Reserve("open", [1] * 16, 16, [], None))
    await server.stop()
    assert receiver.released == ["open"] and receiver.used_blocks == 0
    with pytest.raises(KVTransferError):
        for _ in range(50):  # the client notices the close on its next call at the latest
            await client.reserve(Reserve("again", [1], 1, [], None))
            await asyncio.sleep(0.05)
    await client.close()


async def test_before_authentication_a_peer_gets_only_small_frames(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(struct.pack(">I", 1 << 20))  # within the 2 MiB limit of an authenticated peer
        frame, _ = await read_frame(reader, FrameLimits())
        assert frame == Error("protocol", "header of 1048576 bytes exceeds the limit of 4096")
        writer.close()
    finally:
        await server.stop()


async def test_the_pool_reuses_one_connection_and_reconnects_after_a_break(layout):
    receiver = PoolReceiver(layout)
    server = await started(receiver)
    pool = KVClientPool(layout, SECRET)
    try:
        a, b = await asyncio.gather(pool.get("127.0.0.1", server.port), pool.get("127.0.0.1", server.port))
        assert a is b and server.connections_accepted == 1
        await a.reserve(Reserve("r", [1] * 16, 16, [], None))
        await a.send_blocks("r", 0, random_blocks(layout, 1))
        a._writer.abort()  # the connection breaks (as if the decode pod restarted)
        await eventually(lambda: not a.connected)
        c = await pool.get("127.0.0.1", server.port)
        assert c is not a and c.connected and server.connections_accepted == 2
        assert (await c.reserve(Reserve("r2", [1] * 16, 16, [], None))).ok
        assert pool.bytes_sent == layout.block_nbytes
        await eventually(lambda: receiver.released == ["r"])  # the broken connection's lease
    finally:
        await pool.close()
        await server.stop()


async def test_a_large_transfer_with_smollm2_layout_arrives_bit_exact():
    """14 MiB in one frame: many partial recvs into the payload buffer, writer flow control."""
    layout = KVLayout(block_size=16, dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64,
                      model="smollm2-135m-instruct")
    receiver = PoolReceiver(layout, num_blocks=40)
    server = await started(receiver)
    try:
        async with KVTransferClient("127.0.0.1", server.port, layout, SECRET) as client:
            kv = random_blocks(layout, 40, seed=5)
            await client.reserve(Reserve("big", [1] * 640, 640, [], None))
            assert await client.send_blocks("big", 0, kv) == 40 * 368_640
            assert same_bits(receiver.blocks_of("big"), kv)
    finally:
        await server.stop()


async def test_a_slow_commit_does_not_hold_up_the_next_transfer_on_the_connection(layout):
    """The decode pod acks a commit only once the request joined its batch; meanwhile the same
    connection carries the next request's blocks."""
    receiver = PoolReceiver(layout)
    joined = asyncio.Event()
    plain_commit = receiver.commit

    async def commit_at_next_step(msg):
        if msg.request_id == "first":
            await joined.wait()
        return await plain_commit(msg)
    receiver.commit = commit_at_next_step
    server = await started(receiver)
    try:
        async with KVTransferClient("127.0.0.1", server.port, layout, SECRET) as client:
            await client.reserve(Reserve("first", [1] * 16, 16, [], None))
            first_commit = asyncio.ensure_future(client.commit(commit_msg("first", [1] * 16)))
            kv = random_blocks(layout, 2, seed=9)
            await client.reserve(Reserve("second", [2] * 32, 32, [], None))
            await client.send_blocks("second", 0, kv)
            assert (await client.commit(commit_msg("second", [2] * 32))).ok
            assert not first_commit.done() and list(receiver.committed) == ["second"]
            joined.set()
            assert (await first_commit).ok
            assert list(receiver.committed) == ["second", "first"] and server.active_leases == 0
            assert same_bits(receiver.blocks_of("second"), kv)
    finally:
        await server.stop()
