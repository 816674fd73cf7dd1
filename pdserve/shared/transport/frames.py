"""Every frame of the KV-transfer protocol, with its encoder and decoder beside it.

Wire format of one frame (all integers big-endian)::

    u32 header_len | header (msgpack map) | payload (payload_len raw bytes)

    header = {"type": str, "id": int, "fields": {...}, "payload_len": int}

``id`` pairs a reply with its request (a reply carries the id of the frame it answers; the handshake
uses 0). Only ``Blocks`` has a payload: the raw bytes of a tensor
``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` whose dtype and shape are in its header.
Nothing is unpickled; every field is type-checked; both lengths are checked against hard limits
*before* anything is allocated for them. Any violation raises a :class:`FrameError` subclass, which
closes that one connection.
"""

from __future__ import annotations

import asyncio
import math
import struct
import types
import typing
from dataclasses import MISSING, dataclass, field, fields as dc_fields
from typing import Any, ClassVar, Union

import msgpack
import torch

from pdserve.shared.protocol.sampling_params import SamplingParams, SamplingParamsError
from pdserve.shared.transport.layout import DTYPES

if typing.TYPE_CHECKING:
    from pdserve.shared.transport.stream import FrameConnection

PROTOCOL_VERSION = 1
_PREFIX = struct.Struct(">I")

# A 128k-token prompt's Reserve (token ids + one hex hash per block) is ~1.2 MB of msgpack.
DEFAULT_MAX_HEADER_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
# Payload bytes read per await: bounds the reader's transient buffer, not the frame size.
_READ_CHUNK = 1 << 20


class FrameError(Exception):
    """A frame broke the protocol; the connection that sent it is closed."""


class FrameTooLarge(FrameError):
    """A declared header or payload length exceeds the configured limit."""


class TruncatedFrame(FrameError):
    """The peer closed the connection in the middle of a frame."""


class MalformedFrame(FrameError):
    """Bytes that do not decode to a known frame with well-typed fields."""


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """Hard limits checked before allocating: header bytes and payload bytes of one frame."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES


# --------------------------------------------------------------------------------------------
# Frame types


@dataclass(slots=True)
class Hello:
    """First frame each way. The server's Hello also proves it knows the secret (``mac``)."""

    TYPE: ClassVar[str] = "hello"
    version: int
    layout: dict[str, Any]
    nonce: bytes
    max_payload_bytes: int
    mac: bytes | None = None


@dataclass(slots=True)
class Auth:
    """The client's proof that it knows the secret: HMAC over both nonces."""

    TYPE: ClassVar[str] = "auth"
    mac: bytes


@dataclass(slots=True)
class AuthOk:
    """The server accepted the client: the connection is open for requests."""

    TYPE: ClassVar[str] = "auth_ok"


@dataclass(slots=True)
class Error:
    """A refusal (handshake) or a connection-level protocol error; the sender closes after it."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str


@dataclass(slots=True)
class Reserve:
    """Asks the decode pod to reserve blocks for a request's prompt KV (under a lease)."""

    TYPE: ClassVar[str] = "reserve"
    request_id: str
    prompt_token_ids: list[int]
    num_tokens: int
    block_hashes: list[str] = field(default_factory=list)
    cache_salt: str | None = None


@dataclass(slots=True)
class ReserveReply:
    """``num_cached_blocks``: leading blocks the decode pod already holds; the sender skips them.
    ``duplicate``: the pod already took this request over (a queue entry delivered twice); nothing to send.
    ``full``: refused only because the pod's KV blocks are all in use right now; ask again later."""

    TYPE: ClassVar[str] = "reserve_reply"
    ok: bool
    lease_id: str | None = None
    num_cached_blocks: int = 0
    lease_ttl_s: float = 0.0
    error: str | None = None
    duplicate: bool = False
    full: bool = False


@dataclass(slots=True)
class Blocks:
    """KV blocks ``[first_block_index, first_block_index + n)`` of a request.

    ``payload`` is the raw bytes of a C-contiguous tensor of ``shape`` (``[n, num_layers, 2,
    block_size, num_kv_heads, head_dim]``) and ``dtype`` (a :data:`DTYPES` name).
    """

    TYPE: ClassVar[str] = "blocks"
    request_id: str
    first_block_index: int
    dtype: str
    shape: list[int]
    payload: Any = field(default=b"", repr=False)

    @classmethod
    def from_tensor(cls, request_id: str, first_block_index: int, blocks: torch.Tensor) -> Blocks:
        names = {v: k for k, v in DTYPES.items()}
        if blocks.dtype not in names:
            raise ValueError(f"unsupported KV dtype {blocks.dtype}")
        data = blocks.detach().to("cpu").contiguous()
        # Through uint8, so dtypes numpy lacks (bfloat16) still give their raw bytes.
        payload = memoryview(data.view(torch.uint8).reshape(-1).numpy()) if data.numel() else b""
        return cls(request_id, first_block_index, names[blocks.dtype], list(data.shape), payload)

    def expected_payload_len(self) -> int:
        if self.dtype not in DTYPES:
            raise MalformedFrame(f"blocks.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if len(self.shape) != 6 or any(d < 1 for d in self.shape):
            raise MalformedFrame(f"blocks.shape must be 6 positive dims, got {self.shape}")
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def to_tensor(self) -> torch.Tensor:
        """The received blocks as a tensor (a view on the payload buffer, no copy)."""
        buf = self.payload if isinstance(self.payload, bytearray) else bytearray(self.payload)
        return torch.frombuffer(buf, dtype=torch.uint8).view(DTYPES[self.dtype]).reshape(self.shape)


@dataclass(slots=True)
class BlocksReply:
    TYPE: ClassVar[str] = "blocks_reply"
    ok: bool
    error: str | None = None


@dataclass(slots=True)
class Commit:
    """Hands the request over: its first token and everything the decode pod needs to continue.

    A resumed (migrated) request's reserved KV ends with ``output_token_ids``, the output its client
    already has (``output_text_len`` characters of text); ``first_token_id`` is the token after them.
    """

    TYPE: ClassVar[str] = "commit"
    request_id: str
    first_token_id: int
    sampling_params: SamplingParams  # SamplingParams.to_dict() on the wire
    prompt_token_ids: list[int]
    arrival_time: float
    deadline: float | None = None
    first_token_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_text_len: int = 0
    router_id: str | None = None  # PrefillRequest.router_id
    traceparent: str | None = None  # PrefillRequest.traceparent; left off the wire when None (older receivers)


@dataclass(slots=True)
class CommitReply:
    """``ok``: the request joined the decode pod's batch (only then the prefill pod acks its queue entry)."""

    TYPE: ClassVar[str] = "commit_reply"
    ok: bool
    error: str | None = None


@dataclass(slots=True)
class Abort:
    TYPE: ClassVar[str] = "abort"
    request_id: str


@dataclass(slots=True)
class AbortReply:
    TYPE: ClassVar[str] = "abort_reply"
    ok: bool
    error: str | None = None


@dataclass(slots=True)
class ShmProbe:
    """``shm`` connector, once per connection after the handshake: the sender wrote ``token`` into the shared-memory
    file ``segment``; the decode pod reads it back to prove both pods see the same ``/dev/shm`` (the same host)."""

    TYPE: ClassVar[str] = "shm_probe"
    segment: str
    token: bytes


@dataclass(slots=True)
class ShmProbeReply:
    TYPE: ClassVar[str] = "shm_probe_reply"
    ok: bool
    error: str | None = None


@dataclass(slots=True)
class ShmBlocks:
    """``shm`` connector: a :class:`Blocks` frame whose bytes lie in the shared-memory file ``segment`` (from byte
    ``offset``, ``prod(shape) * itemsize`` bytes) instead of a payload. ``crc32c``: the CRC-32C (Castagnoli, as iSCSI
    and ext4 use) of those bytes, checked by the decode pod before it takes them (TCP checksums its segments; a
    shared file has no such check). Answered by
    :class:`BlocksReply`; the sender may reuse the segment once it has the reply."""

    TYPE: ClassVar[str] = "shm_blocks"
    request_id: str
    first_block_index: int
    dtype: str
    shape: list[int]
    segment: str
    offset: int
    crc32c: int

    def nbytes(self) -> int:
        return Blocks(self.request_id, self.first_block_index, self.dtype, self.shape).expected_payload_len()


Frame = Union[Hello, Auth, AuthOk, Error, Reserve, ReserveReply, Blocks, BlocksReply, Commit,
              CommitReply, Abort, AbortReply, ShmProbe, ShmProbeReply, ShmBlocks]
FRAME_TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (Hello, Auth, AuthOk, Error, Reserve, ReserveReply, Blocks, BlocksReply, Commit,
                CommitReply, Abort, AbortReply, ShmProbe, ShmProbeReply, ShmBlocks)
}
_HINTS = {cls: typing.get_type_hints(cls) for cls in FRAME_TYPES.values()}


# --------------------------------------------------------------------------------------------
# Field checking (the peer is untrusted: no coercion beyond int -> float)


def _check(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _check(value, arm, where)
            except MalformedFrame:
                pass
        raise MalformedFrame(f"{where}: {type(value).__name__} is not {tp}")
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp in (str, bytes):
        if isinstance(value, tp):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            return [_check(v, item, where) for v in value]
    elif origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
    elif tp is SamplingParams:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            try:
                return SamplingParams.from_dict(value)
            except (SamplingParamsError, TypeError) as exc:
                raise MalformedFrame(f"{where}: {exc}") from None
    raise MalformedFrame(f"{where}: {type(value).__name__} is not {getattr(tp, '__name__', tp)}")


def frame_from_fields(type_name: Any, fields: Any) -> Frame:
    """Builds the frame dataclass named ``type_name`` from a peer's field map (payload not set)."""
    cls = FRAME_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise MalformedFrame(f"unknown frame type {type_name!r}")
    if not isinstance(fields, dict):
        raise MalformedFrame(f"{cls.TYPE}: fields must be a map")
    hints = _HINTS[cls]
    kwargs: dict[str, Any] = {}
    for f in dc_fields(cls):
        if f.name == "payload":
            continue
        if f.name in fields:
            kwargs[f.name] = _check(fields[f.name], hints[f.name], f"{cls.TYPE}.{f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise MalformedFrame(f"{cls.TYPE}: missing field {f.name!r}")
    unknown = set(fields) - {f.name for f in dc_fields(cls)} - {"payload"}
    if unknown:
        raise MalformedFrame(f"{cls.TYPE}: unknown fields {sorted(map(str, unknown))}")
    return cls(**kwargs)


def _fields_of(frame: Frame) -> dict[str, Any]:
    out = {f.name: getattr(frame, f.name) for f in dc_fields(frame) if f.name != "payload"}
    if out.get("traceparent", "") is None:  # a receiver before tracing refuses unknown fields
        del out["traceparent"]
    return {k: v.to_dict() if isinstance(v, SamplingParams) else v for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Encoding and decoding


def encode_frame(frame: Frame, frame_id: int = 0) -> list[Any]:
    """The buffers to write for ``frame``: ``[prefix + header, payload?]`` (payload not copied)."""
    payload = frame.payload if isinstance(frame, Blocks) else b""
    payload_len = memoryview(payload).nbytes
    if isinstance(frame, Blocks) and payload_len != frame.expected_payload_len():
        raise ValueError(f"blocks payload is {payload_len} bytes, shape says {frame.expected_payload_len()}")
    header = msgpack.packb(
        {"type": frame.TYPE, "id": frame_id, "fields": _fields_of(frame), "payload_len": payload_len},
        use_bin_type=True,
    )
    out: list[Any] = [_PREFIX.pack(len(header)) + header]
    if payload_len:
        out.append(payload)
    return out


def parse_header(data: bytes, limits: FrameLimits) -> tuple[Frame, int, int]:
    """Decodes a header (already bounded by the caller) into ``(frame, frame_id, payload_len)``.

    Checks the declared payload length against the limit and against the frame's own fields
    (only ``Blocks`` has one, exactly ``prod(shape) * itemsize`` bytes) before anyone reads it.
    """
    try:
        header = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True,
                                 ext_hook=_no_ext)
    except FrameError:
        raise
    except Exception as e:  # msgpack raises ValueError, ExtraData, FormatError, StackError, ...
        raise MalformedFrame(f"undecodable header: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict) or set(header) != {"type", "id", "fields", "payload_len"}:
        raise MalformedFrame("header must be a map of type, id, fields, payload_len")
    frame_id, payload_len = header["id"], header["payload_len"]
    for name, v in (("id", frame_id), ("payload_len", payload_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise MalformedFrame(f"header.{name} must be a non-negative int")
    if payload_len > limits.max_payload_bytes:
        raise FrameTooLarge(f"payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes}")
    frame = frame_from_fields(header["type"], header["fields"])
    expected = frame.expected_payload_len() if isinstance(frame, Blocks) else 0
    if payload_len != expected:
        raise MalformedFrame(f"{frame.TYPE}: payload_len {payload_len} != {expected} implied by its fields")
    return frame, frame_id, payload_len


def _no_ext(code: int, data: bytes) -> Any:
    raise MalformedFrame(f"msgpack extension type {code} is not allowed")


async def read_frame(reader: asyncio.StreamReader | FrameConnection, limits: FrameLimits) -> tuple[Frame, int] | None:
    """Reads one frame: ``(frame, frame_id)``, or ``None`` on a clean EOF between frames.

    Raises :class:`FrameTooLarge`, :class:`TruncatedFrame` or :class:`MalformedFrame`; at most
    ``4 + max_header_bytes + max_payload_bytes`` bytes are ever allocated for one frame.
    """
    try:
        prefix = await reader.readexactly(_PREFIX.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise TruncatedFrame("connection closed inside a frame's length prefix") from None
    (header_len,) = _PREFIX.unpack(prefix)
    if header_len > limits.max_header_bytes:
        raise FrameTooLarge(f"header of {header_len} bytes exceeds the limit of {limits.max_header_bytes}")
    try:
        header = await reader.readexactly(header_len)
    except asyncio.IncompleteReadError:
        raise TruncatedFrame("connection closed inside a frame header") from None
    frame, frame_id, payload_len = parse_header(header, limits)
    if payload_len:
        buf = bytearray(payload_len)
        view = memoryview(buf)
        if hasattr(reader, "readinto"):  # FrameConnection: the kernel writes into buf directly
            try:
                await reader.readinto(view)
            except asyncio.IncompleteReadError as e:
                raise TruncatedFrame(f"connection closed after {len(e.partial)} of {payload_len} payload bytes"
                                     ) from None
        else:
            got = 0
            while got < payload_len:
                chunk = await reader.read(min(_READ_CHUNK, payload_len - got))
                if not chunk:
                    raise TruncatedFrame(f"connection closed after {got} of {payload_len} payload bytes")
                view[got:got + len(chunk)] = chunk
                got += len(chunk)
        frame.payload = buf  # type: ignore[union-attr]
    return frame, frame_id


async def write_frame(writer: asyncio.StreamWriter | FrameConnection, frame: Frame, frame_id: int = 0) -> int:
    """Writes one frame and waits for the transport's buffer to drain; returns bytes written."""
    n = 0
    for buf in encode_frame(frame, frame_id):
        writer.write(buf)
        n += memoryview(buf).nbytes
    await writer.drain()
    return n
