"""The interface the KV-transfer server calls on the decode worker."""

from __future__ import annotations

from typing import Protocol

import torch

from pdserve.shared.transport.frames import Commit, CommitReply, Reserve, ReserveReply
from pdserve.shared.transport.layout import KVLayout


class KVReceiver(Protocol):
    """Implemented by the decode worker; the :class:`KVTransferServer` calls it.

    Calls for one request arrive in order and never overlap. Calls for different requests may
    interleave: a ``commit`` (which may wait until the request joined the batch) runs while the
    same connection's next request is reserved and receives blocks. Exceptions raised here become
    an error reply to the peer (and a ``release``), never a server crash.
    """

    layout: KVLayout

    async def reserve(self, msg: Reserve) -> ReserveReply:
        """Allocates blocks for ``msg.num_tokens`` prompt tokens. ``num_cached_blocks`` in the reply:
        leading blocks (by ``msg.block_hashes`` and ``msg.cache_salt``) already held, which the
        sender skips. ``ok=False`` with ``error`` when it cannot (no free blocks)."""
        ...

    async def receive_blocks(self, request_id: str, first_block_index: int, blocks: torch.Tensor) -> None:
        """Stores ``blocks`` (``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``, CPU, in
        ``layout.dtype``; its shape has been checked against ``layout``) as the request's blocks
        ``first_block_index .. first_block_index + n - 1``. Raises to reject them."""
        ...

    async def commit(self, msg: Commit) -> CommitReply:
        """Adds the request to the running batch; ``ok=True`` only once it has joined."""
        ...

    async def release(self, request_id: str) -> None:
        """Frees everything reserved for the request: its lease expired, the sender aborted, the
        connection dropped before commit, or a receive/commit failed. Must be idempotent."""
        ...
