"""A small but real :class:`KVReceiver` for transport tests: a torch tensor pool with a free list.

It stands in for the decode worker's paged KV cache (which the engine owns); it does the same
bookkeeping a receiver must: allocate on reserve, write received blocks into the pool, free on
release (idempotently).
"""

from __future__ import annotations

import asyncio
import math

import torch

from pdserve.shared.transport import Commit, CommitReply, KVLayout, Reserve, ReserveReply


class PoolReceiver:
    def __init__(self, layout: KVLayout, num_blocks: int = 64) -> None:
        self.layout = layout
        self.pool = torch.zeros((num_blocks, *layout.block_shape), dtype=layout.torch_dtype)
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.committed: dict[str, Commit] = {}
        self.released: list[str] = []
        self.released_event = asyncio.Event()

    async def reserve(self, msg: Reserve) -> ReserveReply:
        n = math.ceil(msg.num_tokens / self.layout.block_size)
        if n > len(self.free):
            return ReserveReply(ok=False, error=f"out of KV blocks: need {n}, {len(self.free)} free")
        self.tables[msg.request_id] = [self.free.pop() for _ in range(n)]
        return ReserveReply(ok=True, num_cached_blocks=0)

    async def receive_blocks(self, request_id: str, first_block_index: int, blocks: torch.Tensor) -> None:
        table = self.tables[request_id]
        ids = table[first_block_index:first_block_index + blocks.shape[0]]
        if len(ids) != blocks.shape[0]:
            raise ValueError(f"blocks {first_block_index}..{first_block_index + blocks.shape[0] - 1} "
                             f"are beyond the {len(table)} reserved")
        self.pool[ids] = blocks

    async def commit(self, msg: Commit) -> CommitReply:
        self.committed[msg.request_id] = msg
        return CommitReply(ok=True)

    async def release(self, request_id: str) -> None:
        self.free.extend(self.tables.pop(request_id, []))
        self.released.append(request_id)
        self.released_event.set()

    def blocks_of(self, request_id: str) -> torch.Tensor:
        return self.pool[self.tables[request_id]]

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)
