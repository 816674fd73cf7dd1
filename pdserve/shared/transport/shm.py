"""The ``shm`` KV connector: pods on one host pass KV block bytes through shared memory (files in ``/dev/shm``).

Control stays on the TCP connection (handshake with layout check and HMAC, reserve, commit, abort, leases: the tcp
connector's server and client). Only the block bytes change path: the sender copies them once into a shared-memory
file it owns and sends an :class:`ShmBlocks` frame (file, offset, shape, CRC-32C); the decode pod maps the file, checks
the CRC-32C and copies the bytes once into its KV pool. With TCP the same bytes cross the socket: written into the
kernel's buffer, then read out of it. Once per connection an :class:`ShmProbe` proves the decode pod reads this pod's
``/dev/shm``; when it does not (another host, another mount namespace, another user), connecting fails with an
error that says so and names the tcp connector.

Files are ``/dev/shm/pdserve-kv-<32 hex>`` (mode 0600), reused by the sender across transfers and removed when its
connection closes; a sender killed with SIGKILL leaves them behind (``rm /dev/shm/pdserve-kv-*``).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import time
import uuid
from pathlib import Path
from typing import ClassVar

import crc32c
import numpy as np
import torch

from pdserve.shared.transport.client import KVTransferClient, KVTransferError
from pdserve.shared.transport.connector import KVConnector
from pdserve.shared.transport.frames import Blocks, BlocksReply, ShmBlocks, ShmProbe, ShmProbeReply
from pdserve.shared.transport.layout import DTYPES
from pdserve.shared.transport.server import KVTransferServer

log = logging.getLogger("pdserve.transport")

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"pdserve-kv-[0-9a-f]{32}")
_MIN_SEGMENT = 1 << 20
_KEPT_SEGMENTS = 4  # free segments a sender keeps for reuse (more concurrent transfers make more, then drop them)


class _Segment:
    """A shared-memory file this process created, mapped read-write."""

    def __init__(self, size: int) -> None:
        self.name = f"pdserve-kv-{uuid.uuid4().hex}"
        self.size = size
        fd = os.open(SHM_DIR / self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def write(self, data: torch.Tensor) -> int:
        """Copies ``data`` (CPU, contiguous) to the start of the file; returns the CRC-32C of its bytes."""
        raw = data.view(torch.uint8).reshape(-1)
        dst = torch.from_numpy(np.frombuffer(self.mm, dtype=np.uint8, count=raw.numel()))
        dst.copy_(raw)
        del dst  # no buffer export may outlive this call: unlink() closes the map
        return crc32c.crc32c(memoryview(self.mm)[:raw.numel()])

    def unlink(self) -> None:
        self.mm.close()
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass


def _segment_path(name: str) -> Path:
    if not _NAME.fullmatch(name):  # a peer's name must not point anywhere else
        raise ValueError(f"bad shared-memory segment name {name!r}")
    return SHM_DIR / name


class ShmKVTransferClient(KVTransferClient):
    """A :class:`KVTransferClient` whose ``send_blocks`` passes the bytes through ``/dev/shm``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._free: list[_Segment] = []

    async def connect(self) -> None:
        """The tcp handshake, then the same-host probe. Raises :class:`KVTransferError` when the decode pod cannot
        read this pod's shared memory."""
        await super().connect()
        try:
            await self._probe()
        except BaseException:
            await self.close()
            raise
        log.info("KV blocks to decode pod %s go through shared memory (kv_connector shm)", self.peer)

    async def _probe(self) -> None:
        token = secrets.token_bytes(16)
        segment = _Segment(len(token))
        segment.mm[:] = token
        try:
            reply = await self._call(ShmProbe(segment.name, token), ShmProbeReply)
        finally:
            segment.unlink()
        if not reply.ok:  # unreachable for this pod: the router moves the request and avoids that pod a while
            raise KVTransferError(f"decode pod {self.peer} cannot take KV blocks through shared memory: {reply.error}. "
                                  f"The shm connector needs both pods on one host sharing /dev/shm; otherwise use "
                                  f"--kv-transfer-config '{{\"kv_connector\": \"tcp\"}}'", connection_lost=True)

    async def send_blocks(self, request_id: str, first_block_index: int, blocks: torch.Tensor) -> int:
        """As :meth:`KVTransferClient.send_blocks`, in one :class:`ShmBlocks` frame whatever the size."""
        if blocks.dtype != self.layout.torch_dtype or tuple(blocks.shape[1:]) != self.layout.block_shape:
            raise ValueError(f"blocks must be [n, {', '.join(map(str, self.layout.block_shape))}] "
                             f"{self.layout.dtype}, got {list(blocks.shape)} {blocks.dtype}")
        if blocks.shape[0] == 0:
            return 0
        start = time.perf_counter()
        data = blocks.detach().to("cpu").contiguous()
        nbytes = data.numel() * data.element_size()
        segment = self._take(nbytes)
        replied = False
        try:
            crc = segment.write(data)
            names = {v: k for k, v in DTYPES.items()}
            frame = ShmBlocks(request_id, first_block_index, names[data.dtype], list(data.shape), segment.name, 0, crc)
            reply = await self._answer(await self._send(frame), f"blocks of {request_id}", "acknowledge")
            replied = True
        finally:
            self.seconds += time.perf_counter() - start
            if replied:
                self._give_back(segment)
            else:  # the pod may still read it: never rewrite it
                segment.unlink()
        self._expect_type(reply, BlocksReply)
        if not reply.ok:
            raise KVTransferError(f"{self.peer} rejected blocks of {request_id}: {reply.error}")
        self.bytes_sent += nbytes
        return nbytes

    def _take(self, nbytes: int) -> _Segment:
        fits = [s for s in self._free if s.size >= nbytes]
        if fits:
            segment = min(fits, key=lambda s: s.size)
            self._free.remove(segment)
            return segment
        return _Segment(max(_MIN_SEGMENT, 1 << (nbytes - 1).bit_length()))

    def _give_back(self, segment: _Segment) -> None:
        self._free.append(segment)
        while len(self._free) > _KEPT_SEGMENTS:
            self._free.pop(self._free.index(min(self._free, key=lambda s: s.size))).unlink()

    async def close(self) -> None:
        await super().close()
        while self._free:
            self._free.pop().unlink()


class ShmKVTransferServer(KVTransferServer):
    """A :class:`KVTransferServer` that also takes :class:`ShmBlocks` (and still takes ``Blocks``).

    Senders reuse their files, so the server keeps its mappings of the last few (mapping a file again costs a page
    fault per 4 KiB on the next read). A kept mapping of a file its sender removed is dropped at the next new file.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}  # segment name -> (inode, private read mapping)

    def shm_probe(self, msg: ShmProbe) -> ShmProbeReply:
        try:
            with open(_segment_path(msg.segment), "rb") as f:
                seen = f.read(len(msg.token) + 1)
        except (OSError, ValueError) as e:
            return ShmProbeReply(ok=False, error=f"cannot read {SHM_DIR / msg.segment} ({e}): not on the same host?")
        if seen != msg.token:
            return ShmProbeReply(ok=False, error=f"{SHM_DIR / msg.segment} holds other bytes here: another /dev/shm")
        return ShmProbeReply(ok=True)

    def blocks_tensor(self, msg: Blocks | ShmBlocks) -> torch.Tensor:
        """The blocks of ``msg``: a ``ShmBlocks`` frame's are a private mapping of the sender's file (no copy), once
        their CRC-32C matches. Raises ``ValueError`` (bad name, out of range, wrong checksum) or ``OSError``."""
        if isinstance(msg, Blocks):
            return msg.to_tensor()
        nbytes = msg.nbytes()
        mm = self._mapping(msg.segment)
        if msg.offset < 0 or msg.offset + nbytes > len(mm):
            raise ValueError(f"{msg.segment}: bytes {msg.offset}..{msg.offset + nbytes} lie outside its {len(mm)}")
        crc = crc32c.crc32c(memoryview(mm)[msg.offset:msg.offset + nbytes])
        if crc != msg.crc32c:
            raise ValueError(f"{msg.segment}: CRC-32C {crc:#010x} != {msg.crc32c:#010x} sent: the bytes changed")
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=msg.offset)
        return raw.view(DTYPES[msg.dtype]).reshape(msg.shape)


    def _mapping(self, name: str) -> mmap.mmap:
        """A private (copy-on-write, never written) mapping of the whole file: the sender's later writes show."""
        path = _segment_path(name)
        inode = os.stat(path).st_ino
        kept = self._maps.get(name)
        if kept is not None and kept[0] == inode:
            return kept[1]
        for other in [n for n in self._maps if not (SHM_DIR / n).exists()]:
            del self._maps[other]  # its sender removed it; tensors still using the mapping keep it alive
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._maps[name] = (inode, mm)
        while len(self._maps) > 2 * _KEPT_SEGMENTS:
            del self._maps[next(iter(self._maps))]
        return mm


class ShmConnector(KVConnector):
    name: ClassVar[str] = "shm"
    client_class = ShmKVTransferClient
    server_class = ShmKVTransferServer
