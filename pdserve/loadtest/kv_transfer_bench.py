"""KV-transfer throughput over loopback, next to plain socket copies of the same bytes.

    python -m pdserve.loadtest.kv_transfer_bench [--blocks 64] [--repeats 7] [--dtype bfloat16 --dtype float32]

For each dtype, ``--blocks`` blocks of SmolLM2-135M's KV layout (30 layers, 3 KV heads, head_dim 64,
block 16; 360 KiB per block in bf16) travel from this process to a server process on 127.0.0.1:

- ``pdserve kv``: KVTransferClient -> KVTransferServer (handshake done once, outside the timing):
  reserve, send_blocks (tensor bytes, no copy on the sender), commit; the server's receiver copies
  the blocks into a preallocated KV pool tensor, as a decode worker does.
- ``asyncio stream``: the same bytes with an 8-byte length prefix over asyncio streams, read into a
  preallocated buffer, acknowledged with one byte.
- ``socket sendall``: the same over blocking sockets (``sendall`` / ``recv_into``).

Each figure is the median over ``--repeats`` transfers of bytes / (first byte sent .. ack received).
The machine's other load shows in the numbers: run on an idle machine for stable figures.

``--connector tcp --connector shm`` (``--turns N``) compares KV connectors instead (docs/ensemble.md "KV
connectors"), in turns (A B A B, a fresh server process each turn): the hand-over's latency (reserve, blocks,
commit; median over ``--repeats``) and the CPU-seconds per block of both processes (sender and decode side, from
/proc), for each dtype.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import statistics
import struct
import time

import click
import torch

from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.transport import (
    Commit, CommitReply, FrameLimits, KVLayout, KVTransferClient, KVTransferServer, Reserve, ReserveReply,
)
from pdserve.shared.transport.connector import KVConnectorFactory

SECRET = "kv-transfer-bench"
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, model="smollm2-135m-instruct")
_ACK = b"\x01"


class _PoolSink:
    """A receiver that writes into a KV pool tensor and frees the blocks at commit (a decode worker's copy)."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.pool = torch.empty((num_blocks, *layout.block_shape), dtype=layout.torch_dtype)

    async def reserve(self, msg: Reserve) -> ReserveReply:
        return ReserveReply(ok=True)

    async def receive_blocks(self, request_id: str, first_block_index: int, blocks: torch.Tensor) -> None:
        self.pool[first_block_index:first_block_index + blocks.shape[0]].copy_(blocks)

    async def commit(self, msg: Commit) -> CommitReply:
        return CommitReply(ok=True)

    async def release(self, request_id: str) -> None:
        pass


def _serve_kv(layout_dict: dict, num_blocks: int, port_q: mp.Queue) -> None:
    async def main() -> None:
        layout = KVLayout(**layout_dict)
        server = KVTransferServer(_PoolSink(layout, num_blocks), SECRET, host="127.0.0.1", port=0,
                                  limits=FrameLimits(max_payload_bytes=1 << 30))
        await server.start()
        port_q.put(server.port)
        await asyncio.Event().wait()
    asyncio.run(main())


def _serve_connector(name: str, layout_dict: dict, num_blocks: int, port_q: mp.Queue) -> None:
    async def main() -> None:
        layout = KVLayout(**layout_dict)
        connector = KVConnectorFactory.create_connector({"kv_connector": name})
        server = connector.receiver_server(_PoolSink(layout, num_blocks), SECRET, "127.0.0.1", 0,
                                           limits=FrameLimits(max_payload_bytes=1 << 30))
        await server.start()
        port_q.put(server.port)
        await asyncio.Event().wait()
    torch.set_num_threads(1)
    asyncio.run(main())


def _cpu_s(pid: int | None = None) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _bench_connector(name: str, layout: KVLayout, blocks: torch.Tensor, repeats: int) -> dict:
    """One turn of one connector: hand-over latencies (s) and CPU-s of sender and receiver over the timed ones."""
    proc, port = _spawn(_serve_connector, name, layout.to_dict(), blocks.shape[0])
    try:
        connector = KVConnectorFactory.create_connector({"kv_connector": name})
        client = connector.client_class("127.0.0.1", port, layout, SECRET,
                                        limits=FrameLimits(max_payload_bytes=1 << 30))
        await client.connect()
        n_tokens = blocks.shape[0] * layout.block_size
        times, cpu = [], {}
        for i in range(repeats + 1):  # the first is a warm-up
            if i == 1:
                cpu = {"sender": _cpu_s(), "receiver": _cpu_s(proc.pid)}
            rid = f"bench-{i}"
            start = time.perf_counter()
            await client.reserve(Reserve(rid, [0] * n_tokens, n_tokens, [], None))
            await client.send_blocks(rid, 0, blocks)
            reply = await client.commit(Commit(rid, 0, SamplingParams(), [0] * n_tokens, time.time()))
            assert reply.ok
            times.append(time.perf_counter() - start)
        cpu = {"sender": _cpu_s() - cpu["sender"], "receiver": _cpu_s(proc.pid) - cpu["receiver"]}
        await client.close()
        return {"times": times[1:], **cpu}
    finally:
        proc.kill()


def run_connectors(connectors: list[str], num_blocks: int, repeats: int, turns: int, dtypes: list[str]) -> list[dict]:
    """Per dtype and connector, over ``turns`` turns (A B A B): median hand-over ms and CPU-ms per block."""
    rows = []
    for dtype in dtypes:
        layout = KVLayout(dtype=dtype, **SMOLLM2)
        blocks = torch.randn(num_blocks, *layout.block_shape).to(layout.torch_dtype)
        got: dict[str, list[dict]] = {name: [] for name in connectors}
        for _ in range(turns):
            for name in connectors:
                got[name].append(asyncio.run(_bench_connector(name, layout, blocks, repeats)))
        for name, turns_ in got.items():
            n = repeats * turns * num_blocks
            rows.append(dict(dtype=dtype, connector=name, mib=blocks.numel() * blocks.element_size() / 2**20,
                             ms=statistics.median(t for r in turns_ for t in r["times"]) * 1e3,
                             per_turn=[statistics.median(r["times"]) * 1e3 for r in turns_],
                             sender_us=sum(r["sender"] for r in turns_) / n * 1e6,
                             receiver_us=sum(r["receiver"] for r in turns_) / n * 1e6))
    return rows


def format_connectors(rows: list[dict], num_blocks: int, repeats: int, turns: int) -> str:
    lines = [f"KV connectors in turns: {num_blocks} blocks of SmolLM2-135M's layout per hand-over, {repeats} "
             f"hand-overs x {turns} turns; ms: median hand-over (reserve + blocks + commit); CPU-us per block",
             f"{'dtype':<10}{'connector':<11}{'MiB':>7}{'ms':>9}{'ms per turn':>24}{'sender':>9}{'receiver':>10}"]
    for r in rows:
        per_turn = " ".join(f"{t:.1f}" for t in r["per_turn"])
        lines.append(f"{r['dtype']:<10}{r['connector']:<11}{r['mib']:>7.1f}{r['ms']:>9.2f}{per_turn:>24}"
                     f"{r['sender_us']:>9.1f}{r['receiver_us']:>10.1f}")
    return "\n".join(lines)


def _serve_asyncio(port_q: mp.Queue) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = struct.unpack(">Q", await reader.readexactly(8))
                buf = memoryview(bytearray(n))
                got = 0
                while got < n:
                    chunk = await reader.read(min(1 << 20, n - got))
                    buf[got:got + len(chunk)] = chunk
                    got += len(chunk)
                writer.write(_ACK)
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=1 << 20)
        port_q.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()
    asyncio.run(main())


def _serve_socket(port_q: mp.Queue) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_q.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    with conn:
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            (n,) = struct.unpack(">Q", head)
            buf = memoryview(bytearray(n))
            got = 0
            while got < n:
                got += conn.recv_into(buf[got:], min(1 << 20, n - got))
            conn.sendall(_ACK)


def _spawn(target, *args) -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q), daemon=True)
    proc.start()
    return proc, q.get(timeout=60)


async def _bench_kv(layout: KVLayout, blocks: torch.Tensor, repeats: int) -> list[float]:
    proc, port = _spawn(_serve_kv, layout.to_dict(), blocks.shape[0])
    try:
        client = KVTransferClient("127.0.0.1", port, layout, SECRET, limits=FrameLimits(max_payload_bytes=1 << 30))
        await client.connect()
        n_tokens = blocks.shape[0] * layout.block_size
        times = []
        for i in range(repeats + 1):  # the first is a warm-up
            rid = f"bench-{i}"
            start = time.perf_counter()
            await client.reserve(Reserve(rid, [0] * n_tokens, n_tokens, [], None))
            await client.send_blocks(rid, 0, blocks)
            reply = await client.commit(Commit(rid, 0, SamplingParams(), [0] * n_tokens, time.time()))
            assert reply.ok
            times.append(time.perf_counter() - start)
        await client.close()
        return times[1:]
    finally:
        proc.kill()


async def _bench_asyncio(data: memoryview, repeats: int) -> list[float]:
    proc, port = _spawn(_serve_asyncio)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            writer.write(struct.pack(">Q", data.nbytes))
            writer.write(data)
            await writer.drain()
            await reader.readexactly(1)
            times.append(time.perf_counter() - start)
        writer.close()
        return times[1:]
    finally:
        proc.kill()


def _bench_socket(data: memoryview, repeats: int) -> list[float]:
    proc, port = _spawn(_serve_socket)
    try:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                conn.sendall(struct.pack(">Q", data.nbytes))
                conn.sendall(data)
                assert conn.recv(1) == _ACK
                times.append(time.perf_counter() - start)
        return times[1:]
    finally:
        proc.kill()


def run(num_blocks: int, repeats: int, dtypes: list[str]) -> list[dict]:
    rows = []
    for dtype in dtypes:
        layout = KVLayout(dtype=dtype, **SMOLLM2)
        blocks = torch.randn(num_blocks, *layout.block_shape).to(layout.torch_dtype)
        data = memoryview(blocks.view(torch.uint8).reshape(-1).numpy())
        nbytes = data.nbytes
        kv = statistics.median(asyncio.run(_bench_kv(layout, blocks, repeats)))
        aio = statistics.median(asyncio.run(_bench_asyncio(data, repeats)))
        sock = statistics.median(_bench_socket(data, repeats))
        rows.append(dict(dtype=dtype, mib=nbytes / 2**20, kv=nbytes / kv / 1e9, aio=nbytes / aio / 1e9,
                         sock=nbytes / sock / 1e9, kv_ms=kv * 1e3))
    return rows


def format_table(rows: list[dict], num_blocks: int, repeats: int) -> str:
    lines = [
        f"KV transfer over loopback: {num_blocks} blocks of SmolLM2-135M's layout (30 layers, 3 KV heads, "
        f"head_dim 64, block 16), median of {repeats}",
        f"{'dtype':<10}{'MiB':>8}{'pdserve kv GB/s':>17}{'(ms)':>8}{'asyncio GB/s':>14}{'socket GB/s':>13}"
        f"{'kv/socket':>11}",
    ]
    for r in rows:
        lines.append(f"{r['dtype']:<10}{r['mib']:>8.1f}{r['kv']:>17.2f}{r['kv_ms']:>8.1f}{r['aio']:>14.2f}"
                     f"{r['sock']:>13.2f}{r['kv'] / r['sock']:>10.0%}")
    return "\n".join(lines)


@click.command("kv-transfer")
@click.option("--blocks", "num_blocks", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--dtype", "dtypes", type=click.Choice(["bfloat16", "float32", "float16"]), multiple=True,
              default=("bfloat16", "float32"), show_default=True)
@click.option("--connector", "connectors", multiple=True,
              help="Compare these KV connectors in turns instead (e.g. --connector tcp --connector shm).")
@click.option("--turns", type=click.IntRange(min=1), default=2, show_default=True, help="Turns with --connector.")
def kv_transfer_command(num_blocks: int, repeats: int, dtypes: tuple[str, ...], connectors: tuple[str, ...],
                        turns: int) -> None:
    """KV-transfer throughput over loopback next to a plain socket copy of the same bytes, or KV connectors
    compared in turns (--connector)."""
    torch.set_num_threads(1)
    if connectors:
        for name in connectors:
            try:
                KVConnectorFactory.create_connector({"kv_connector": name})
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--connector") from None
            if name == "loopback":
                raise click.BadParameter("loopback serves only its own process; the bench's server is another one",
                                         param_hint="--connector")
        rows = run_connectors(list(connectors), num_blocks, repeats, turns, list(dtypes))
        click.echo(format_connectors(rows, num_blocks, repeats, turns))
        return
    click.echo(format_table(run(num_blocks, repeats, list(dtypes)), num_blocks, repeats))


if __name__ == "__main__":
    kv_transfer_command()
