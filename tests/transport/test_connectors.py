"""Every KV connector (tcp, loopback, shm) passes the same block-transfer contract, into a real tensor pool
(support/kv_pool.py); connector names and ``--kv-transfer-config`` errors; shm's own integrity and same-host checks."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from support.kv_pool import PoolReceiver
from test_kv_transfer import SECRET, commit_msg, random_blocks, same_bits

from pdserve.shared.transport import KVTransferError, Reserve
from pdserve.shared.transport import shm
from pdserve.shared.transport.connector import KVConnectorError, KVConnectorFactory, KVTransferConfig
from pdserve.shared.transport.handshake import HandshakeError

pytestmark = [pytest.mark.timeout(60)]

BACKENDS = ["tcp", "loopback", "shm"]


@pytest.fixture(params=BACKENDS)
def connector(request):
    return KVConnectorFactory.create_connector(f'{{"kv_connector": "{request.param}"}}')


async def serving(connector, receiver, **kw):
    server = connector.receiver_server(receiver, SECRET, "127.0.0.1", 0, **kw)
    await server.start()
    return server


def sender(connector, server, layout, secret=SECRET):
    endpoint = connector.endpoint("127.0.0.1", connector.pod_fields(server)["kv_endpoint"])
    return connector.client_class(endpoint.host, endpoint.port, layout, secret)


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_blocks_arrive_bit_exact_past_the_cached_ones_and_commit_closes_the_lease(connector, layout, dtype):
    layout = dataclasses.replace(layout, dtype=dtype)
    receiver = PoolReceiver(layout)
    server = await serving(connector, receiver)
    try:
        async with sender(connector, server, layout) as client:
            prompt = list(range(100, 177))  # 5 blocks, the last one partial
            kv = random_blocks(layout, 5)
            reply = await client.reserve(Reserve("req-1", prompt, len(prompt), [], None))
            assert reply.ok and server.active_leases == 1
            await client.send_blocks("req-1", 0, kv[:2])
            await client.send_blocks("req-1", 2, kv[2:])  # as after num_cached_blocks=2: from block 2 on
            assert (await client.commit(commit_msg("req-1", prompt))).ok
            assert same_bits(receiver.blocks_of("req-1"), kv)
            assert receiver.committed["req-1"] == commit_msg("req-1", prompt)
            assert server.active_leases == 0 and receiver.released == []
            assert client.bytes_sent == server.bytes_received == 5 * layout.block_nbytes
            assert server.blocks_received == 5
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_concurrent_requests_on_one_connection_each_get_their_blocks(connector, layout):
    receiver = PoolReceiver(layout)
    server = await serving(connector, receiver)
    try:
        async with sender(connector, server, layout) as client:
            kvs = {f"r{i}": random_blocks(layout, 3, seed=i) for i in range(4)}
            for rid in kvs:
                assert (await client.reserve(Reserve(rid, [1] * 40, 40, [], None))).ok
            await asyncio.gather(*[client.send_blocks(rid, 0, kv) for rid, kv in kvs.items()])
            assert all(same_bits(receiver.blocks_of(rid), kv) for rid, kv in kvs.items())
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_a_rejected_send_and_an_abort_release_the_blocks(connector, layout):
    receiver = PoolReceiver(layout)
    server = await serving(connector, receiver)
    try:
        async with sender(connector, server, layout) as client:
            await client.reserve(Reserve("r", [1] * 20, 20, [], None))  # 2 blocks
            with pytest.raises(KVTransferError, match="blocks 0..2 are beyond the 2 reserved"):
                await client.send_blocks("r", 0, random_blocks(layout, 3))
            assert receiver.released == ["r"] and receiver.used_blocks == 0
            await client.reserve(Reserve("a", [1] * 40, 40, [], None))
            assert await client.abort("a") is True
            assert receiver.released == ["r", "a"] and receiver.used_blocks == 0 and server.active_leases == 0
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_a_sender_without_the_secret_is_refused(connector, layout):
    server = await serving(connector, PoolReceiver(layout))
    try:
        with pytest.raises(HandshakeError, match="auth_failed"):
            await sender(connector, server, layout, secret="another-secret").connect()
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_the_sender_pool_reuses_one_connection_per_decode_pod(connector, layout):
    server = await serving(connector, PoolReceiver(layout))
    pool = connector.sender_pool(layout, SECRET)
    try:
        port = connector.pod_fields(server)["kv_port"]
        first = await pool.get("127.0.0.1", port)
        assert await pool.get("127.0.0.1", port) is first and isinstance(first, connector.client_class)
    finally:
        await pool.close()
        await server.stop()


# shm only


@pytest.mark.asyncio
async def test_shm_refuses_blocks_whose_bytes_changed_after_their_checksum(layout, monkeypatch):
    connector = KVConnectorFactory.create_connector({"kv_connector": "shm"})
    receiver = PoolReceiver(layout)
    server = await serving(connector, receiver)
    write = shm._Segment.write

    def write_then_flip_a_byte(self, data):
        crc = write(self, data)
        self.mm[7] ^= 0xFF
        return crc

    monkeypatch.setattr(shm._Segment, "write", write_then_flip_a_byte)
    try:
        async with sender(connector, server, layout) as client:
            await client.reserve(Reserve("r", [1] * 20, 20, [], None))
            with pytest.raises(KVTransferError, match="CRC-32C .* the bytes changed"):
                await client.send_blocks("r", 0, random_blocks(layout, 2))
            assert receiver.released == ["r"] and receiver.used_blocks == 0
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_shm_to_a_pod_that_does_not_share_dev_shm_fails_at_connect_naming_tcp(layout, tmp_path, monkeypatch):
    connector = KVConnectorFactory.create_connector({"kv_connector": "shm"})
    server = await serving(connector, PoolReceiver(layout))
    # the decode pod looks into another /dev/shm, as on another host
    monkeypatch.setattr(shm, "_segment_path", lambda name: tmp_path / name)
    try:
        with pytest.raises(KVTransferError, match="not on the same host.*kv_connector.*tcp") as exc:
            await sender(connector, server, layout).connect()
        assert exc.value.unreachable  # the router moves the request to another decode pod
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_shm_sender_to_a_tcp_decode_pod_fails_at_connect(layout):
    tcp = KVConnectorFactory.create_connector(None)
    server = await serving(tcp, PoolReceiver(layout))
    try:
        client = KVConnectorFactory.create_connector({"kv_connector": "shm"}).client_class(
            "127.0.0.1", server.port, layout, SECRET)
        with pytest.raises(KVTransferError, match="kv_connector is 'tcp', not 'shm'"):
            await client.connect()
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_shm_removes_its_files_when_the_connection_closes(layout):
    connector = KVConnectorFactory.create_connector({"kv_connector": "shm"})
    server = await serving(connector, PoolReceiver(layout))
    try:
        async with sender(connector, server, layout) as client:
            await client.reserve(Reserve("r", [1] * 20, 20, [], None))
            await client.send_blocks("r", 0, random_blocks(layout, 2))
            files = [shm.SHM_DIR / s.name for s in client._free]
            assert files and all(f.exists() for f in files)
        assert not any(f.exists() for f in files)
    finally:
        await server.stop()


# names and config (no transfer)


def test_the_registered_connectors_are_tcp_loopback_and_shm():
    assert KVConnectorFactory.names() == ["loopback", "shm", "tcp"]
    assert KVConnectorFactory.create_connector(None).name == "tcp"
    assert KVTransferConfig.parse('{"kv_connector": "shm", "kv_role": "kv_both"}').kv_connector == "shm"


@pytest.mark.parametrize(("text", "error"), [
    ('{"kv_connector": "nixl"}', "unknown kv_connector 'nixl'; registered: loopback, shm, tcp"),
    ('{"kv_connector": "tcp", "kv_port": 1}', "unknown field(s) kv_port (known: kv_connector, kv_connector_extra_config, kv_role)"),
    ('{"kv_connector": ', "kv_transfer_config is not valid JSON"),
    ('["tcp"]', "kv_transfer_config must be a JSON object, got list"),
    ('{"kv_connector": "tcp", "kv_role": "kv_sender"}', "kv_role must be one of kv_producer, kv_consumer, kv_both"),
])
def test_a_bad_kv_transfer_config_is_refused_with_a_clear_error(text, error):
    with pytest.raises(KVConnectorError) as exc:
        KVConnectorFactory.create_connector(text)
    assert error in str(exc.value)


@pytest.mark.asyncio
async def test_each_backend_endpoint_travels_from_the_registry_through_the_router_to_the_prefill_pod(connector, layout):
    # the decode pod advertises its backend's own fields; the router copies them into the queue entry unread; the
    # prefill pod's connector parses them back into the endpoint its sender reaches the server at
    from pdserve.services.router.dispatch import ChoiceSpec, build_requests
    from pdserve.services.router.placement import Placement
    from pdserve.shared.protocol.messages import PrefillRequest
    from pdserve.shared.protocol.registry import PodInfo
    from pdserve.shared.protocol.sampling_params import SamplingParams

    server = await serving(connector, PoolReceiver(layout))
    try:
        pod = PodInfo(pod_id="decode-0", role="decode", host="127.0.0.1", http_port=8001, model="m",
                      **connector.pod_fields(server))
        pod = PodInfo.model_validate_json(pod.model_dump_json())  # as the registry stores and serves it
        assert pod.kv_endpoint == connector.endpoint_fields(server)
        [req] = build_requests(Placement(pod, local_prefill=False), [1, 2, 3],
                               [ChoiceSpec("r-1", 0, SamplingParams(max_tokens=2))], model="m", router_id=None)
        req = PrefillRequest.decode(req.encode())
        endpoint = connector.endpoint(req.decode_host, req.decode_kv_endpoint)
        assert (endpoint.host, endpoint.port) == ("127.0.0.1", server.port)
        async with connector.client_class(endpoint.host, endpoint.port, layout, SECRET) as client:
            assert (await client.reserve(Reserve("r-1", [1, 2, 3], 3, [], None))).ok
    finally:
        await server.stop()


def test_an_endpoint_without_its_backend_field_is_refused_naming_it():
    loopback = KVConnectorFactory.create_connector('{"kv_connector": "loopback"}')
    with pytest.raises(KVConnectorError, match="'loopback_id'"):
        loopback.endpoint("10.0.0.1", {"port": 9000})  # a tcp pod's fields
    tcp = KVConnectorFactory.create_connector(None)
    with pytest.raises(KVConnectorError, match="'port' must be a port"):
        tcp.endpoint("10.0.0.1", {"port": "9000"})
    assert tcp.endpoint("10.0.0.1", 9000).port == 9000  # a bare kv_port: a router that predates kv_endpoint
