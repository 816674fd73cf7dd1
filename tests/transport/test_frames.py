"""The frame codec: every frame round-trips; any other bytes raise FrameError only, within the limits."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.transport.frames import (
    Abort, AbortReply, Auth, AuthOk, Blocks, BlocksReply, Commit, CommitReply, Error, FrameError, FrameLimits,
    FrameTooLarge, Hello, MalformedFrame, Reserve, ReserveReply, TruncatedFrame, encode_frame, read_frame,
)

LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=64 * 1024)


def read_all(data: bytes, limits: FrameLimits = LIMITS) -> list:
    """Parses a byte stream the way a connection does: frames until EOF or the first FrameError."""
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        frames = []
        while (got := await read_frame(reader, limits)) is not None:
            frames.append(got)
        return frames
    return asyncio.run(go())


def wire(frame, frame_id: int = 0) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) if not isinstance(b, bytes) else b
                    for b in encode_frame(frame, frame_id))


SAMPLES = [
    Hello(1, {"block_size": 16, "dtype": "bfloat16", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
              "model": "smollm2-135m-instruct"}, b"\x01" * 32, 1 << 28, mac=b"\x02" * 32),
    Auth(b"\x03" * 32), AuthOk(), Error("auth_failed", "no"),
    Reserve("r-1", [1, 2, 3], 3, ["ab" * 32], "tenant-a"),
    ReserveReply(ok=True, lease_id="L", num_cached_blocks=2, lease_ttl_s=30.0),
    ReserveReply(ok=False, error="out of KV blocks"),
    Blocks.from_tensor("r-1", 4, torch.arange(2 * 2 * 2 * 16 * 3 * 8, dtype=torch.float32).reshape(2, 2, 2, 16, 3, 8)),
    BlocksReply(ok=True), Commit("r-1", 7, SamplingParams(temperature=0.5, stop=["\n"]), [1, 2, 3], 1.5, None, 2.5),
    CommitReply(ok=False, error="x"), Abort("r-1"), AbortReply(ok=True),
]


@pytest.mark.parametrize("frame", SAMPLES, ids=lambda f: f.TYPE)
def test_every_frame_round_trips(frame):
    [(got, frame_id)] = read_all(wire(frame, 9), FrameLimits())
    assert frame_id == 9
    if isinstance(frame, Blocks):
        assert (got.request_id, got.first_block_index, got.dtype, got.shape) == (
            frame.request_id, frame.first_block_index, frame.dtype, frame.shape)
        assert torch.equal(got.to_tensor(), torch.frombuffer(bytearray(frame.payload), dtype=torch.float32)
                           .reshape(frame.shape))
    else:
        assert got == frame


def header(type_: object, fields: object, payload_len: object = 0, frame_id: object = 0) -> bytes:
    h = msgpack.packb({"type": type_, "id": frame_id, "fields": fields, "payload_len": payload_len})
    return struct.pack(">I", len(h)) + h


@pytest.mark.parametrize(("data", "exc", "message"), [
    (b"\x00\x01", TruncatedFrame, "connection closed inside a frame's length prefix"),
    (b"\x00\x00\x00\x10abc", TruncatedFrame, "connection closed inside a frame header"),
    (b"\x00\x10\x00\x01", FrameTooLarge, "header of 1048577 bytes exceeds the limit of 4096"),
    (header("abort", {"request_id": "x"}, payload_len=1 << 40), FrameTooLarge,
     "payload of 1099511627776 bytes exceeds the limit of 65536"),
    (header("pickle", {}), MalformedFrame, "unknown frame type 'pickle'"),
    (header("abort", {"request_id": 5}), MalformedFrame, "abort.request_id: int is not str"),
    (header("abort", {}), MalformedFrame, "abort: missing field 'request_id'"),
    (header("abort", {"request_id": "x", "evil": 1}), MalformedFrame, "abort: unknown fields ['evil']"),
    (header("abort", {"request_id": "x"}, payload_len=3), MalformedFrame,
     "abort: payload_len 3 != 0 implied by its fields"),
    (header("blocks", {"request_id": "x", "first_block_index": 0, "dtype": "float64", "shape": [1] * 6}, 8),
     MalformedFrame, "blocks.dtype 'float64' is not one of ['bfloat16', 'float16', 'float32']"),
    (header("blocks", {"request_id": "x", "first_block_index": 0, "dtype": "float32", "shape": [1, 2, 2]}, 16),
     MalformedFrame, "blocks.shape must be 6 positive dims, got [1, 2, 2]"),
    (header("blocks", {"request_id": "x", "first_block_index": 0, "dtype": "float32", "shape": [1] * 6}, 4) + b"ab",
     TruncatedFrame, "connection closed after 2 of 4 payload bytes"),
    (header("reserve_reply", {"ok": 1}), MalformedFrame, "reserve_reply.ok: int is not bool"),
    (b"\x00\x00\x00\x01\xc1", MalformedFrame, "undecodable header"),
])
def test_bad_bytes_raise_the_specific_error(data, exc, message):
    with pytest.raises(exc) as info:
        read_all(data)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, FrameError)


def test_msgpack_extension_types_are_refused():
    h = msgpack.packb({"type": "abort", "id": 0, "fields": {"request_id": msgpack.ExtType(1, b"x")},
                       "payload_len": 0})
    with pytest.raises(MalformedFrame, match="extension type 1 is not allowed"):
        read_all(struct.pack(">I", len(h)) + h)


# ----------------------------------------------------------------------------------------------
# fuzzing

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


@st.composite
def hostile_streams(draw) -> bytes:
    kind = draw(st.sampled_from(["random", "truncated", "mutated", "random_header", "huge_lengths"]))
    if kind == "random":
        return draw(st.binary(max_size=600))
    valid = b"".join(wire(f, i) for i, f in enumerate(draw(st.lists(st.sampled_from(SAMPLES), min_size=1,
                                                                    max_size=3))))
    if kind == "truncated":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    if kind == "mutated":
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "random_header":
        fields = draw(st.dictionaries(st.sampled_from(["request_id", "ok", "shape", "dtype", "first_block_index",
                                                        "mac", "x"]), msgpack_values, max_size=5))
        return header(draw(st.sampled_from(sorted({f.TYPE for f in SAMPLES}) + ["?"])), fields,
                      draw(st.integers(0, 2**64 - 1)), draw(msgpack_values)) + draw(st.binary(max_size=64))
    return struct.pack(">I", draw(st.integers(0, 2**32 - 1))) + draw(st.binary(max_size=64))


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_streams())
def test_fuzzed_streams_raise_only_frame_errors_and_allocate_within_the_limits(data):
    tracemalloc.start()
    try:
        try:
            read_all(data)
        except FrameError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One frame may hold its header and payload; everything else is small change.
    assert peak < LIMITS.max_header_bytes + LIMITS.max_payload_bytes + 512 * 1024
