"""Bookkeeping for preemption by swap: a CPU block pool that holds a preempted request's KV.

vLLM v0's ``swap`` preemption mode: the victim's blocks are copied to host memory and its device
blocks freed; on resume, fresh device blocks are allocated and the data copied back. The copies
themselves are done by ``KVCache`` before the step's forward pass (swap-out, then swap-in).
"""

from __future__ import annotations

from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import Request


class SwapManager:
    def __init__(self, kv: KVCacheManager, num_cpu_blocks: int) -> None:
        self.kv = kv
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks = list(range(num_cpu_blocks - 1, -1, -1))
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        # leading blocks a sliding window had freed (null placeholders): not copied, restored as placeholders
        self.req_to_skipped: dict[str, int] = {}

    def can_swap_out(self, request: Request) -> bool:
        held = self.kv.num_held_blocks(request.request_id) - self.kv.num_skipped(request.request_id)
        return held <= len(self.free_cpu_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        skipped = self.kv.num_skipped(request.request_id)
        device_ids = self.kv.get_block_ids(request.request_id)[skipped:]
        cpu_ids = [self.free_cpu_blocks.pop() for _ in device_ids]
        self.req_to_cpu_blocks[request.request_id] = cpu_ids
        self.req_to_skipped[request.request_id] = skipped
        self.kv.free(request)
        return list(zip(device_ids, cpu_ids))

    def can_swap_in(self, request: Request, num_blocks_needed: int | None = None) -> bool:
        """Whether the device pool has ``num_blocks_needed`` free blocks (default: the swapped blocks + 1,
        the slot a decode step usually needs; a count of the request's whole table, placeholders included)."""
        held = len(self.req_to_cpu_blocks[request.request_id])
        skipped = self.req_to_skipped[request.request_id]
        needed = held + 1 if num_blocks_needed is None else max(held, num_blocks_needed - skipped)
        return needed <= self.kv.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        cpu_ids = self.req_to_cpu_blocks.pop(request.request_id)
        skipped = self.req_to_skipped.pop(request.request_id)
        device_ids = self.kv.allocate_uncached(request, len(cpu_ids), num_skipped=skipped)
        self.free_cpu_blocks.extend(reversed(cpu_ids))
        return list(zip(cpu_ids, device_ids))

    def free(self, request: Request) -> None:
        self.req_to_skipped.pop(request.request_id, None)
        self.free_cpu_blocks.extend(reversed(self.req_to_cpu_blocks.pop(request.request_id, [])))

    @property
    def num_used_cpu_blocks(self) -> int:
        return self.num_cpu_blocks - len(self.free_cpu_blocks)
