"""Disaggregated prefill/decode: a request's KV leaves one engine and joins another's running batch.

Prefill side (``PrefillExport``): a ``prefill_only`` request *parks* after its first token: it leaves the
batch but keeps its blocks; ``take_exports`` reads the KV of every parked request and releases its blocks
(they stay in the prefix cache). Decode side (``DecodeImport``): ``reserve`` takes blocks for a prompt whose KV
will arrive (prefix-cache hits already here are not sent, nor blocks its offloading tiers hold: those load on the
loader thread meanwhile), ``write_kv`` fills them, ``commit`` turns the reservation into a request that joins the
running batch once its tier load is in (``take_loaded``), ``release`` gives it up. Both work through the
scheduler's and the KV cache manager's narrow methods only.

KV travels as ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` (``KVCache.read_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.shared.engine.input_processor import RequestRejected
from pdserve.shared.engine.kv_cache import KVCache
from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import Request, RequestStatus
from pdserve.shared.engine.scheduler import Scheduler

Export = tuple[list[str], torch.Tensor]  # (hex hashes of the full blocks, KV of every block with computed tokens)


class PrefillExport:
    def __init__(self, scheduler: Scheduler, kv_manager: KVCacheManager, kv_cache: KVCache) -> None:
        self.scheduler = scheduler
        self.kv = kv_manager
        self.kv_cache = kv_cache
        self.parked: dict[str, Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parked

    def park(self, request: Request) -> None:
        """The request sampled its first token: out of the batch, blocks held until exported."""
        self.scheduler.detach(request)
        self.parked[request.request_id] = request

    def export_kv(self, request_id: str, first_block: int = 0) -> Export:
        """KV of a parked request's computed tokens (its prompt, plus the output of a resumed request; not the
        token just sampled): (hex block hashes of its full blocks, KV of blocks ``first_block:``)."""
        request = self.parked[request_id]
        num_kv_tokens = request.num_tokens - 1
        bs = self.kv.block_size
        ids = self.kv.get_block_ids(request_id)[: -(-num_kv_tokens // bs)]
        hashes = [h.hex() for h in request.update_block_hashes(bs)]
        return hashes[: num_kv_tokens // bs], self.kv_cache.read_blocks(ids[first_block:])

    def release(self, request_id: str) -> bool:
        """Free a parked request's blocks; returns whether it was parked."""
        request = self.parked.pop(request_id, None)
        if request is None:
            return False
        request.status = RequestStatus.FINISHED_STOPPED
        self.kv.free(request)
        return True

    def take_exports(self) -> dict[str, Export]:
        """Export and release every parked request, in the order they parked."""
        exports = {request_id: self.export_kv(request_id) for request_id in self.parked}
        for request_id in exports:
            self.release(request_id)
        return exports


class DecodeImport:
    def __init__(self, scheduler: Scheduler, kv_manager: KVCacheManager, kv_cache: KVCache) -> None:
        self.scheduler = scheduler
        self.kv = kv_manager
        self.kv_cache = kv_cache
        self.reserved: dict[str, Request] = {}
        self.loading: list[Request] = []  # committed, out of the batch until their tier load is in
        self.tier_blocks: dict[str, int] = {}  # request id -> blocks its reservation loads from the tiers

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.reserved

    def reserve(self, request: Request) -> tuple[int, int] | None:
        """Blocks for every token of ``request`` (a placeholder holding the KV's tokens). Returns
        ``(num_blocks, num_cached_blocks)``: the leading cached blocks are prefix-cache hits already here or blocks
        an offloading tier holds, loading now (the sender skips them all); ``None`` when the pool is short now.
        The received blocks enter the prefix cache once the request joins the batch (their content is not here
        before).

        The answer does not wait for the tier load (it would stall the batch, and the sender would wait for it
        before sending anything): the load overlaps the transfer of the other blocks and the steps meanwhile, and
        only this request waits for it, after its commit. Counting the loading blocks as cached also keeps them
        off the wire."""
        reserved = self.kv.get_reserved_blocks(request)
        if reserved is None:
            return None
        computed, num_loading = reserved
        if num_loading:
            self.tier_blocks[request.request_id] = num_loading
        num_computed = len(computed) * self.kv.block_size
        allocated = self.kv.allocate_slots(request, request.num_tokens - num_computed, computed, cache=False)
        assert allocated is not None, "get_reserved_blocks checked the room"
        self.kv.record_prefix_cache_stats(request, num_computed, "transfer")
        request.num_cached_tokens = num_computed
        self.reserved[request.request_id] = request
        return len(self.kv.get_block_ids(request.request_id)), len(computed)

    def write_kv(self, request_id: str, first_block: int, data: torch.Tensor) -> None:
        """Copy received blocks into the reservation. Raises ``KeyError`` when there is none (the request was
        aborted meanwhile), ``ValueError`` outside it or on a shape/dtype mismatch."""
        if request_id not in self.reserved:
            raise KeyError(f"request {request_id!r} holds no reservation here (aborted, or its lease ended)")
        ids = self.kv.get_block_ids(request_id)
        if first_block < 0 or first_block + data.shape[0] > len(ids):
            raise ValueError(f"blocks {first_block}..{first_block + data.shape[0]} outside the reservation of {len(ids)}")
        self.kv_cache.write_blocks(ids[first_block : first_block + data.shape[0]], data)

    def commit(self, request_id: str, output_token_ids: Sequence[int],
               build: Callable[[list[int], str | None], Request]) -> Request:
        """The reservation's KV is complete: ``build(prompt_token_ids, cache_salt)`` makes the request (it
        validates, raising ``ValueError``), which joins the running batch with all its tokens computed.

        The reservation holds the KV of the prompt, then of ``output_token_ids`` (a resumed request), which must
        be its last tokens. Raises ``KeyError`` without a reservation; on ``ValueError`` the blocks are freed."""
        reserved = self.reserved.pop(request_id)
        tokens = reserved.prompt_token_ids
        split = len(tokens) - len(output_token_ids)
        try:
            if split < 1 or tokens[split:] != list(output_token_ids):
                raise RequestRejected("output_token_ids must be the last tokens of the reserved KV", "output_token_ids")
            request = build(tokens[:split], reserved.cache_salt)
        except ValueError:
            self.tier_blocks.pop(request_id, None)
            self.kv.free(reserved)
            raise
        request.num_computed_tokens = request.num_tokens
        request.num_cached_tokens = reserved.num_cached_tokens
        self.scheduler.add_running(request)
        if not self._join(request):
            self.loading.append(request)  # the engine takes it out of the batch until it is in (``take_loaded``)
        return request

    def _join(self, request: Request) -> bool:
        """Whether the request's tier load is in (then its blocks enter the prefix cache). Blocks that did not
        arrive, and every one after them, are recomputed: ``num_computed_tokens`` goes back to the first of them,
        and none of them is registered until the scheduler computes it."""
        num_loading = self.tier_blocks.get(request.request_id, 0)
        arrived = self.kv.finish_load(request.request_id) if num_loading else 0
        if arrived is None:
            return False
        self.tier_blocks.pop(request.request_id, None)
        bs = self.kv.block_size
        first_missing = request.num_cached_tokens // bs - (num_loading - arrived)
        if arrived < num_loading:
            self.kv.num_cached_block[request.request_id] = first_missing
            request.num_computed_tokens = first_missing * bs
            return True
        self.kv.cache_blocks(request, request.num_computed_tokens)
        return True

    def take_loaded(self) -> list[Request]:
        """Committed requests whose tier load is now in, to rejoin the running batch."""
        ready = [r for r in self.loading if self._join(r)]
        for request in ready:
            self.loading.remove(request)
        return ready

    def discard(self, members: list[Request]) -> list[Request]:
        """Drop ``members`` that wait for their tier load (aborted); returns them (they still hold their blocks)."""
        gone = [r for r in members if r in self.loading]
        for request in gone:
            self.loading.remove(request)
            self.tier_blocks.pop(request.request_id, None)
        return gone

    def release(self, request_id: str) -> bool:
        """Give up a reservation; returns whether there was one."""
        request = self.reserved.pop(request_id, None)
        if request is not None:
            self.tier_blocks.pop(request_id, None)
            self.kv.free(request)  # a tier load still running keeps its blocks pinned until it is done
        return request is not None
