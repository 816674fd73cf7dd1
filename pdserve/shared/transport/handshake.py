"""Connection handshake: KV-layout agreement and mutual HMAC-SHA256 challenge-response.

Sequence (every frame from :mod:`frames`)::

    client -> Hello(version, layout, nonce_c, max_payload_bytes)
    server -> Hello(version, layout, nonce_s, max_payload_bytes, mac=HMAC(k, "server"|nonce_c|nonce_s))
              or Error(layout_mismatch | version_mismatch)
    client -> Auth(mac=HMAC(k, "client"|nonce_c|nonce_s))      or Error(auth_failed | layout_mismatch)
    server -> AuthOk                                           or Error(auth_failed)

Both nonces are 32 fresh random bytes, so neither proof can be replayed on another connection, and
the role label keeps one side's proof from being reflected back as the other's. The secret never
crosses the wire; MACs are compared in constant time (``hmac.compare_digest``). A refusal is logged
on the refusing side and sent to the peer as an ``Error`` frame, which the peer logs and raises as
:class:`HandshakeError`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Any

from pdserve.shared.transport.frames import (
    PROTOCOL_VERSION, Auth, AuthOk, Error, FrameError, FrameLimits, Hello, read_frame, write_frame,
)
from pdserve.shared.transport.layout import KVLayout

log = logging.getLogger("pdserve.transport")

NONCE_BYTES = 32
# Before the peer is authenticated it gets small frames only: a stranger cannot make us buffer MBs.
HANDSHAKE_LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=0)
Reader = Any  # asyncio.StreamReader or FrameConnection
Writer = Any  # asyncio.StreamWriter or FrameConnection
_LABEL = b"pdserve-kv-transfer/1|"


class HandshakeError(Exception):
    """The peer was refused (or refused us) at connect. ``code``: layout_mismatch, auth_failed,
    version_mismatch, protocol or timeout."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def secret_bytes(secret: str | bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the KV-transfer secret must not be empty (PDSERVE_KV_TRANSFER_SECRET)")
    return key


def _mac(key: bytes, role: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(key, _LABEL + role + b"|" + nonce_c + nonce_s, hashlib.sha256).digest()


async def _refuse(writer: Writer, code: str, message: str, peer: str, side: str) -> HandshakeError:
    log.warning("KV-transfer %s refused peer %s: %s: %s", side, peer, code, message)
    try:
        await write_frame(writer, Error(code, message))
    except (ConnectionError, OSError):
        pass
    return HandshakeError(code, message)


async def _expect(reader: Reader, peer: str, side: str, *types_: type):
    got = await read_frame(reader, HANDSHAKE_LIMITS)
    if got is None:
        raise HandshakeError("protocol", f"{peer} closed the connection during the handshake")
    frame, _ = got
    if isinstance(frame, Error):
        log.warning("KV-transfer %s was refused by peer %s: %s: %s", side, peer, frame.code, frame.message)
        raise HandshakeError(frame.code, frame.message)
    if not isinstance(frame, types_):
        raise HandshakeError("protocol", f"expected {'/'.join(t.TYPE for t in types_)}, got {frame.TYPE}")
    return frame


async def client_handshake(
    reader: Reader, writer: Writer, layout: KVLayout, secret: str | bytes,
    limits: FrameLimits, peer: str,
) -> int:
    """Runs the client side; returns the server's max payload bytes. ``limits.max_payload_bytes`` is
    announced to the server (the handshake itself reads with ``HANDSHAKE_LIMITS``). Raises
    :class:`HandshakeError`."""
    key = secret_bytes(secret)
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    await write_frame(writer, Hello(PROTOCOL_VERSION, layout.to_dict(), nonce_c, limits.max_payload_bytes))
    try:
        hello = await _expect(reader, peer, "client", Hello)
    except FrameError as e:
        raise HandshakeError("protocol", f"bad frame from {peer}: {e}") from None
    try:
        theirs = KVLayout.from_dict(hello.layout)
    except (TypeError, ValueError) as e:
        raise await _refuse(writer, "protocol", f"invalid layout: {e}", peer, "client") from None
    diff = layout.mismatch(theirs, mine="client", theirs="server")
    if diff:
        raise await _refuse(writer, "layout_mismatch", f"KV layout mismatch: {diff}", peer, "client")
    if (hello.mac is None or len(hello.nonce) != NONCE_BYTES
            or not hmac.compare_digest(hello.mac, _mac(key, b"server", nonce_c, hello.nonce))):
        raise await _refuse(writer, "auth_failed",
                            "server failed the shared-secret challenge (PDSERVE_KV_TRANSFER_SECRET differs)",
                            peer, "client")
    await write_frame(writer, Auth(_mac(key, b"client", nonce_c, hello.nonce)))
    try:
        await _expect(reader, peer, "client", AuthOk)
    except FrameError as e:
        raise HandshakeError("protocol", f"bad frame from {peer}: {e}") from None
    return hello.max_payload_bytes


async def server_handshake(
    reader: Reader, writer: Writer, layout: KVLayout, secret: str | bytes,
    limits: FrameLimits, peer: str,
) -> int:
    """Runs the server side; returns the client's max payload bytes. Raises :class:`HandshakeError`
    (after sending the peer an ``Error`` frame) or :class:`FrameError`."""
    key = secret_bytes(secret)
    hello = await _expect(reader, peer, "server", Hello)
    if hello.version != PROTOCOL_VERSION:
        raise await _refuse(writer, "version_mismatch",
                            f"protocol version server {PROTOCOL_VERSION} != client {hello.version}", peer, "server")
    try:
        theirs = KVLayout.from_dict(hello.layout)
    except (TypeError, ValueError) as e:
        raise await _refuse(writer, "protocol", f"invalid layout: {e}", peer, "server") from None
    diff = layout.mismatch(theirs, mine="server", theirs="client")
    if diff:
        raise await _refuse(writer, "layout_mismatch", f"KV layout mismatch: {diff}", peer, "server")
    if len(hello.nonce) != NONCE_BYTES:
        raise await _refuse(writer, "protocol", f"nonce must be {NONCE_BYTES} bytes", peer, "server")
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    await write_frame(writer, Hello(PROTOCOL_VERSION, layout.to_dict(), nonce_s, limits.max_payload_bytes,
                                    mac=_mac(key, b"server", hello.nonce, nonce_s)))
    auth = await _expect(reader, peer, "server", Auth)
    if not hmac.compare_digest(auth.mac, _mac(key, b"client", hello.nonce, nonce_s)):
        raise await _refuse(writer, "auth_failed",
                            "client failed the shared-secret challenge (PDSERVE_KV_TRANSFER_SECRET differs)",
                            peer, "server")
    await write_frame(writer, AuthOk())
    return hello.max_payload_bytes
