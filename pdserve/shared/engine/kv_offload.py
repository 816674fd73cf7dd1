"""KV offloading tiers below the device pool: host memory (``cpu``), then local disk (``disk``).

A block the prefix cache evicts from the device pool (a free block with a hash, popped to be reused) is written
down a tier instead of dropped: into the CPU tier, whose LRU victims go to the disk tier, whose LRU victims are
dropped (vLLM's ``OffloadingConnector`` with its LRU manager; Dynamo's KV block manager: device, host, disk).
Keys are block hashes, which chain ``cache_salt`` from the first block on (``protocol/block_hash.py``), so tenants
never share a block in any tier. A prefix hit in a tier is loaded back into a freshly allocated device block
before the step that reads it. The load runs on a loader thread (``start_loads``): the request waits out of the
batch, pinning the device blocks it loads into, while the batch keeps stepping (vLLM's ``WAITING_FOR_REMOTE_KVS``);
a decode pod's reservation for a hand-over loads the same way, and its request joins the batch once the load is in
(``kv_load.py``).
Tiers are inclusive: a loaded block stays where it was, so evicting it again writes nothing.

Admission (optional, off by default): with ``store_threshold`` N >= 2, an evicted block is written down only once
requests have looked it up at least N times (vLLM's reuse-frequency gate, ``FilterReusedOffloadingManager`` with
its ``store_threshold`` and ``max_tracker_size``). ``note_seen`` counts each admitted request's full prompt blocks
in a bounded LRU table (``tracker_size`` hashes); a block evicted below the threshold is dropped and counted in the
first tier's ``stores_skipped``. One-shot prompts then never churn the tiers; a block that comes back is written at
its next eviction (so a multi-turn history is recomputed once more before the tiers keep it).

Disk files (one per block, ``<hash hex>.kv``): ``MAGIC``, a 4-byte little-endian header length, a JSON header
(the KV layout: model, dtype, block size, layers, KV heads, head dim, TP rank and size; the payload's CRC-32 and
length) and the payload (the block's bytes, ``KVCache.read_blocks``'s layout). A file whose layout differs from
the engine's (foreign) or whose length or checksum does not match (torn, bit-flipped) is counted in
``bad_files`` and never loaded. A write that fails (``ENOSPC``, any ``OSError``) is refused and counted; serving
goes on without the block. A restarted engine indexes the directory (oldest file first in LRU order).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from pdserve.shared.protocol.block_hash import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"PDSERVE-KV-BLOCK-1\n"
TIERS = ("cpu", "disk")


@dataclass(slots=True)
class TierStats:
    """Running totals of one tier (bytes, tokens, seconds) and its gauges (blocks)."""

    blocks_used: int = 0
    blocks_total: int = 0
    hit_tokens: int = 0
    bytes_written: int = 0
    bytes_loaded: int = 0
    blocks_loaded: int = 0
    load_seconds: float = 0.0
    evictions: int = 0  # blocks dropped out of this tier (to the next one, or gone from the last)
    bad_files: int = 0  # disk: torn, bit-flipped or foreign files skipped
    writes_refused: int = 0  # disk: writes that failed (ENOSPC, I/O errors)
    stores_skipped: int = 0  # evicted blocks not written: seen fewer than store_threshold times (admission)


class CPUTier:
    """Blocks in host memory, LRU order (oldest first), at most ``capacity`` of them."""

    name = "cpu"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self.stats = TierStats(blocks_total=capacity)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def put(self, block_hash: BlockHash, data: torch.Tensor) -> list[tuple[BlockHash, torch.Tensor]]:
        """Store (or refresh) a block; returns the LRU blocks pushed out to make room."""
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return []
        self.blocks[block_hash] = data
        self.stats.bytes_written += data.numel() * data.element_size()
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False))
        self.stats.evictions += len(evicted)
        self.stats.blocks_used = len(self.blocks)
        return evicted

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        data = self.blocks.get(block_hash)
        if data is not None:
            self.blocks.move_to_end(block_hash)
        return data

    def hashes(self) -> list[BlockHash]:
        return list(self.blocks)


class DiskTier:
    """One file per block under ``path``, LRU order, at most ``capacity_bytes`` of files.

    ``layout``: the KV layout every file's header must equal (``KVOffloadManager.layout``); ``shape``/``dtype``
    of one block's tensor. Raises ``OSError`` when ``path`` cannot be created."""

    name = "disk"

    def __init__(self, path: str, capacity_bytes: int, layout: dict, shape: tuple[int, ...], dtype: torch.dtype):
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.shape = shape
        self.dtype = dtype
        self.files: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file size
        self.bytes_used = 0
        self.stats = TierStats()
        os.makedirs(path, exist_ok=True)
        self._index()

    def _file(self, block_hash: BlockHash) -> str:
        return os.path.join(self.path, block_hash.hex() + ".kv")

    def _index(self) -> None:
        """Index the files a previous run left (headers only; payload checksums are verified on load)."""
        entries = []
        for name in os.listdir(self.path):
            if not name.endswith(".kv"):
                continue
            full = os.path.join(self.path, name)
            try:
                block_hash = bytes.fromhex(name[:-3])
                with open(full, "rb") as f:
                    header = self._read_header(f)
                size = os.path.getsize(full)
                ok = header is not None and size == header["_offset"] + header["nbytes"]
            except (OSError, ValueError):
                ok = False
            if not ok:
                self.stats.bad_files += 1
                continue
            entries.append((os.path.getmtime(full), block_hash, size))
        for _, block_hash, size in sorted(entries):
            self.files[block_hash] = size
            self.bytes_used += size
        self._update_gauges()
        if entries or self.stats.bad_files:
            logger.info("KV disk tier %s: indexed %d blocks (%d bad files skipped)", self.path, len(self.files),
                        self.stats.bad_files)

    def _read_header(self, f) -> dict | None:
        """The header if the file is ours and its layout is this engine's, else None."""
        if f.read(len(MAGIC)) != MAGIC:
            return None
        raw = f.read(4)
        if len(raw) != 4:
            return None
        (n,) = struct.unpack("<I", raw)
        header = json.loads(f.read(n))
        if header.get("layout") != self.layout:
            return None
        header["_offset"] = len(MAGIC) + 4 + n
        return header

    def _update_gauges(self) -> None:
        self.stats.blocks_used = len(self.files)
        per_block = next(iter(self.files.values()), 0)
        self.stats.blocks_total = self.capacity_bytes // per_block if per_block else 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.files

    def put(self, block_hash: BlockHash, data: torch.Tensor) -> list[BlockHash]:
        """Write a block (a refresh when present); returns the hashes dropped out of the tier (LRU victims).
        A failed write is refused (counted, nothing raised)."""
        if block_hash in self.files:
            self.files.move_to_end(block_hash)
            return []
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        # fixed-width checksum: every file of one layout has the same size (the capacity in blocks is exact)
        header = json.dumps({"layout": self.layout, "crc32": f"{zlib.crc32(payload):08x}",
                             "nbytes": len(payload)}).encode()
        blob = MAGIC + struct.pack("<I", len(header)) + header + payload
        if len(blob) > self.capacity_bytes:
            self.stats.writes_refused += 1
            return []
        dropped = []
        while self.bytes_used + len(blob) > self.capacity_bytes:
            victim, size = self.files.popitem(last=False)
            self._remove(victim)
            self.bytes_used -= size
            dropped.append(victim)
        self.stats.evictions += len(dropped)
        path = self._file(block_hash)
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # readers see a whole file or none
        except OSError as e:
            self.stats.writes_refused += 1
            logger.warning("KV disk tier: write refused (%s); serving goes on without the block", e)
            self._remove(block_hash, suffix=".tmp")
        else:
            self.files[block_hash] = len(blob)
            self.bytes_used += len(blob)
            self.stats.bytes_written += len(payload)
        self._update_gauges()
        return dropped

    def _remove(self, block_hash: BlockHash, suffix: str = "") -> None:
        try:
            os.remove(self._file(block_hash) + suffix)
        except OSError:
            pass

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block, or None when absent or bad (a bad file is counted, dropped and deleted)."""
        if block_hash not in self.files:
            return None
        self.files.move_to_end(block_hash)
        data = self.read(block_hash)
        if data is None:
            self.discard_bad(block_hash)
        return data

    def read(self, block_hash: BlockHash) -> torch.Tensor | None:
        """Read and verify one block file; touches no index state, so a loader thread may call it outside the
        manager's lock. None when the file is missing, torn, foreign or fails its checksum."""
        try:
            with open(self._file(block_hash), "rb") as f:
                header = self._read_header(f)
                payload = f.read() if header is not None else b""
        except (OSError, ValueError):
            return None
        if header is None or len(payload) != header["nbytes"] or f"{zlib.crc32(payload):08x}" != header["crc32"]:
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).reshape(self.shape)

    def discard_bad(self, block_hash: BlockHash) -> bool:
        """Count, unindex and delete a block whose file did not verify; False when it was gone already (evicted
        while being read: not a bad file)."""
        if block_hash not in self.files:
            return False
        self.stats.bad_files += 1
        self.bytes_used -= self.files.pop(block_hash)
        self._remove(block_hash)
        self._update_gauges()
        logger.warning("KV disk tier: skipped a bad block file %s", self._file(block_hash))
        return True

    def hashes(self) -> list[BlockHash]:
        return list(self.files)


class KVOffloadManager:
    """The tiers of one engine: ``offload`` a block the device pool evicts, ``start_loads`` to bring blocks back.

    ``read_block(block_id) -> [layers, 2, block_size, kv_heads, head_dim]`` and ``write_block(block_id, data)``
    copy one block out of and into the device pool; ``block_tokens``: tokens per block (for hit counts).
    ``emit(kind, block_hashes, medium)``, when set, receives every ``stored``/``removed`` change of a tier.
    ``store_threshold``/``tracker_size``: the admission gate (module docstring); 1 writes every evicted block."""

    def __init__(self, cpu: CPUTier, disk: DiskTier | None, read_block, write_block, block_tokens: int,
                 store_threshold: int = 1, tracker_size: int = 64000) -> None:
        if store_threshold < 1 or tracker_size < 1:
            raise ValueError(f"store_threshold and tracker_size must be >= 1, got {store_threshold}, {tracker_size}")
        self.cpu = cpu
        self.disk = disk
        self.read_block = read_block
        self.write_block = write_block
        self.block_tokens = block_tokens
        self.emit = None
        self.store_threshold = store_threshold
        self.tracker_size = tracker_size
        self.seen: OrderedDict[BlockHash, int] = OrderedDict()  # block hash -> lookups, LRU (admission gate only)
        # the tiers' indexes are shared by the engine thread (offload, lookups) and the loader thread (loads)
        self._lock = threading.RLock()
        self._loader: ThreadPoolExecutor | None = None

    def announce(self) -> None:
        """Emit ``stored`` for every block the tiers hold (a restarted pod re-announces its disk tier)."""
        for medium, hashes in self.hashes().items():
            self._event("stored", hashes, medium)

    def _event(self, kind: str, hashes: list[BlockHash], medium: str) -> None:
        if self.emit is not None and hashes:
            self.emit(kind, list(hashes), medium)

    def tier_of(self, block_hash: BlockHash) -> str | None:
        with self._lock:
            if block_hash in self.cpu:
                return "cpu"
            if self.disk is not None and block_hash in self.disk:
                return "disk"
            return None

    def note_seen(self, hashes: list[BlockHash]) -> None:
        """Count one lookup of each of a request's full blocks (the admission gate's tracker; a no-op without it)."""
        if self.store_threshold <= 1:
            return
        with self._lock:
            seen = self.seen
            for h in hashes:
                seen[h] = seen.get(h, 0) + 1
                seen.move_to_end(h)
            while len(seen) > self.tracker_size:
                seen.popitem(last=False)

    def offload(self, block_hash: BlockHash, block_id: int) -> None:
        """Write a block the device pool is evicting down the tiers (its data is still in place)."""
        with self._lock:
            self._offload(block_hash, block_id)

    def _offload(self, block_hash: BlockHash, block_id: int) -> None:
        if block_hash in self.cpu:
            self.cpu.blocks.move_to_end(block_hash)  # already offloaded (tiers are inclusive): refresh only
            return
        if self.disk is not None and block_hash in self.disk:
            self.disk.files.move_to_end(block_hash)
            return
        if self.store_threshold > 1 and self.seen.get(block_hash, 0) < self.store_threshold:
            first = self.cpu if self.cpu.capacity or self.disk is None else self.disk
            first.stats.stores_skipped += 1
            return
        data = self.read_block(block_id)
        self._put_cpu(block_hash, data)

    def _put_cpu(self, block_hash: BlockHash, data: torch.Tensor) -> None:
        if self.cpu.capacity == 0:
            self._put_disk([(block_hash, data)])
            return
        self._event("stored", [block_hash], "cpu")
        evicted = self.cpu.put(block_hash, data)
        self._event("removed", [h for h, _ in evicted], "cpu")
        self._put_disk(evicted)

    def _put_disk(self, blocks: list[tuple[BlockHash, torch.Tensor]]) -> None:
        if self.disk is None:
            return
        for block_hash, data in blocks:
            if block_hash in self.disk:
                self.disk.files.move_to_end(block_hash)
                continue
            dropped = self.disk.put(block_hash, data)
            self._event("removed", dropped, "disk")
            if block_hash in self.disk:
                self._event("stored", [block_hash], "disk")

    def emit_removed_disk(self, block_hash: BlockHash) -> None:
        """A bad file left the disk tier (the loader found it; events go out on the engine thread)."""
        self._event("removed", [block_hash], "disk")

    def _load_one(self, block_hash: BlockHash, block_id: int,
                  cpu_copy: torch.Tensor | None = None) -> tuple[str | None, bool]:
        """Copy a block from the highest tier holding it into device block ``block_id``, without events (the loader
        thread): ``(tier name or None, a bad file was dropped)``.
        ``cpu_copy``: the CPU tier's block taken earlier (``take_cpu_copies``). The disk read runs outside the
        lock, so evictions the step writes down do not wait for it."""
        start = time.perf_counter()
        with self._lock:
            if cpu_copy is not None:
                tier, data = self.cpu, cpu_copy
            elif block_hash in self.cpu:
                tier, data = self.cpu, self.cpu.get(block_hash)
            elif self.disk is not None and block_hash in self.disk:
                tier, data = self.disk, None
                self.disk.files.move_to_end(block_hash)
            else:
                return None, False
        if data is None:
            data = self.disk.read(block_hash)
            if data is None:
                with self._lock:
                    return None, self.disk.discard_bad(block_hash)
        self.write_block(block_id, data)
        with self._lock:
            s = tier.stats
            s.blocks_loaded += 1
            s.bytes_loaded += data.numel() * data.element_size()
            s.hit_tokens += self.block_tokens
            s.load_seconds += time.perf_counter() - start
        return tier.name, False

    def take_cpu_copies(self, hashes: list[BlockHash]) -> list[torch.Tensor | None]:
        """The CPU tier's blocks among ``hashes`` (references; None for the others), taken before the caller takes
        device blocks for the load: those evictions write into the CPU tier and may push these blocks to disk."""
        with self._lock:
            return [self.cpu.get(h) if h in self.cpu else None for h in hashes]

    def start_loads(self, jobs: list[tuple[BlockHash, int, torch.Tensor | None]]) -> Future:
        """Load ``(block hash, device block id, CPU copy or None)`` in order on the loader thread, stopping at the
        first block no tier holds a good copy of. The future's result: one ``(tier name or None, bad file)`` per
        block tried. The caller keeps the device blocks pinned until the future is done."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        return self._loader.submit(self._load_chain, jobs)

    def _load_chain(self, jobs: list[tuple[BlockHash, int, torch.Tensor | None]]) -> list[tuple[str | None, bool]]:
        results = []
        for block_hash, block_id, cpu_copy in jobs:
            results.append(self._load_one(block_hash, block_id, cpu_copy))
            if results[-1][0] is None:
                break
        return results

    def hashes(self) -> dict[str, list[BlockHash]]:
        """Every block hash per tier now (``cpu``, ``disk``)."""
        with self._lock:
            return {"cpu": self.cpu.hashes(), "disk": self.disk.hashes() if self.disk is not None else []}

    def tier_stats(self) -> dict[str, TierStats]:
        """A copy of both tiers' ``TierStats``, by tier name (a missing disk tier: zeros)."""
        with self._lock:  # the loader threads count hits and bytes as they go
            return {name: replace(tier.stats) if tier is not None else TierStats()
                    for name, tier in (("cpu", self.cpu), ("disk", self.disk))}


def build_offload(config, model_dir: str, kv_spec, kv_cache) -> KVOffloadManager | None:
    """The tiers ``config`` asks for (``kv_offloading_size`` GiB of host memory, a disk tier at
    ``kv_offloading_disk_path`` of ``kv_offloading_disk_size`` GiB), or None for neither."""
    if not config.kv_offloading_size and not config.kv_offloading_disk_path:
        return None
    cpu = CPUTier(round((config.kv_offloading_size or 0) * 2**30) // kv_spec.bytes_per_block)
    disk = None
    if config.kv_offloading_disk_path:
        layout = {"model": os.path.basename(os.path.normpath(model_dir)), "dtype": str(kv_spec.dtype),
                  "block_size": kv_spec.block_size, "num_layers": kv_spec.num_layers,
                  "num_kv_heads": kv_spec.num_kv_heads, "head_dim": kv_spec.head_dim,
                  "tp_rank": 0, "tp_size": config.tensor_parallel_size}
        shape = (kv_spec.num_layers, 2, kv_spec.block_size, kv_spec.num_kv_heads, kv_spec.head_dim)
        disk = DiskTier(config.kv_offloading_disk_path, round(config.kv_offloading_disk_size * 2**30), layout, shape,
                        kv_spec.dtype)
    return KVOffloadManager(cpu, disk, lambda block_id: kv_cache.read_blocks([block_id])[0].to("cpu"),
                            lambda block_id, data: kv_cache.write_blocks([block_id], data.unsqueeze(0)),
                            kv_spec.block_size, config.kv_offloading_store_threshold,
                            config.kv_offloading_tracker_size)
