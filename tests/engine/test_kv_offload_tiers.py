"""The offloading tiers on their own (no model): LRU order, the disk tier's file checks, refused writes, and the
block events each tier emits (docs/engine.md "KV offloading tiers")."""

from __future__ import annotations

import errno
import os

import torch

from pdserve.shared.engine.kv_offload import CPUTier, DiskTier, KVOffloadManager

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, KV heads, head dim
LAYOUT = {"model": "m", "dtype": "torch.bfloat16", "block_size": 4, "num_layers": 2, "num_kv_heads": 1,
          "head_dim": 8, "tp_rank": 0, "tp_size": 1}


def _block(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _disk(path, blocks: int = 8, layout=LAYOUT) -> DiskTier:
    tier = DiskTier(str(path), 1, layout, SHAPE, torch.bfloat16)
    tier.capacity_bytes = blocks * _file_size(path, layout)
    return tier


def _file_size(path, layout) -> int:
    probe = DiskTier(str(path) + "-probe", 2**30, layout, SHAPE, torch.bfloat16)
    probe.put(_h(999), _block(0))
    return probe.files[_h(999)]


def test_cpu_tier_evicts_least_recently_used_first():
    tier = CPUTier(2)
    assert tier.put(_h(1), _block(1)) == [] and tier.put(_h(2), _block(2)) == []
    tier.get(_h(1))  # 1 is now the most recent
    evicted = tier.put(_h(3), _block(3))
    assert [h for h, _ in evicted] == [_h(2)] and torch.equal(evicted[0][1], _block(2))
    assert tier.hashes() == [_h(1), _h(3)] and tier.stats.evictions == 1 and tier.stats.blocks_used == 2


def test_disk_tier_round_trips_bit_exact_and_survives_a_restart(tmp_path):
    tier = _disk(tmp_path)
    for i in range(3):
        tier.put(_h(i), _block(i))
    restarted = _disk(tmp_path)
    assert set(restarted.hashes()) == {_h(0), _h(1), _h(2)}
    for i in range(3):
        assert torch.equal(restarted.get(_h(i)), _block(i))
    assert restarted.stats.bad_files == 0


def test_disk_tier_keeps_its_size_limit_by_dropping_the_least_recently_used(tmp_path):
    tier = _disk(tmp_path, blocks=2)
    tier.put(_h(1), _block(1))
    tier.put(_h(2), _block(2))
    assert tier.get(_h(1)) is not None
    assert tier.put(_h(3), _block(3)) == [_h(2)]
    assert sorted(os.listdir(tmp_path)) == sorted(_h(i).hex() + ".kv" for i in (1, 3))
    assert tier.stats.evictions == 1 and tier.bytes_used <= tier.capacity_bytes


def test_foreign_torn_and_flipped_files_are_counted_and_never_loaded(tmp_path):
    tier = _disk(tmp_path)
    for i in range(3):
        tier.put(_h(i), _block(i))
    _disk(tmp_path / "other", layout={**LAYOUT, "tp_size": 2}).put(_h(5), _block(5))
    os.replace(tmp_path / "other" / (_h(5).hex() + ".kv"), tmp_path / (_h(5).hex() + ".kv"))  # foreign layout
    path = tmp_path / (_h(0).hex() + ".kv")
    os.truncate(path, os.path.getsize(path) - 1)  # torn
    restarted = _disk(tmp_path)
    assert set(restarted.hashes()) == {_h(1), _h(2)} and restarted.stats.bad_files == 2
    with open(tmp_path / (_h(1).hex() + ".kv"), "r+b") as f:  # one bit flipped in the payload
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    assert restarted.get(_h(1)) is None and restarted.stats.bad_files == 3
    assert _h(1) not in restarted and torch.equal(restarted.get(_h(2)), _block(2))


def test_a_full_disk_refuses_writes_and_the_tier_keeps_serving(tmp_path, monkeypatch):
    tier = _disk(tmp_path)
    tier.put(_h(1), _block(1))

    def enospc(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", enospc)
    assert tier.put(_h(2), _block(2)) == []
    assert tier.stats.writes_refused == 1 and _h(2) not in tier
    assert os.listdir(tmp_path) == [_h(1).hex() + ".kv"]  # no partial file left behind
    assert torch.equal(tier.get(_h(1)), _block(1))


def test_offload_manager_writes_down_the_tiers_and_emits_each_tiers_events(tmp_path):
    device = {7: _block(7), 8: _block(8), 9: _block(9)}
    loaded = {}
    events = []
    manager = KVOffloadManager(CPUTier(1), _disk(tmp_path), device.__getitem__, loaded.__setitem__, 4)
    manager.emit = lambda kind, hashes, medium: events.append((kind, hashes, medium))
    manager.offload(_h(1), 7)
    manager.offload(_h(2), 8)  # pushes 1 from the CPU tier to disk
    assert [manager.tier_of(_h(i)) for i in (1, 2, 3)] == ["disk", "cpu", None]
    assert events == [("stored", [_h(1)], "cpu"), ("stored", [_h(2)], "cpu"), ("removed", [_h(1)], "cpu"),
                      ("stored", [_h(1)], "disk")]
    loads = manager.start_loads([(_h(1), 3, None), (_h(2), 4, None), (_h(3), 5, None)]).result(10)  # loader thread
    assert loads == [("disk", False), ("cpu", False), (None, False)]
    assert torch.equal(loaded[3], _block(7)) and torch.equal(loaded[4], _block(8)) and 5 not in loaded
    stats = manager.tier_stats()
    assert stats["cpu"].hit_tokens == 4 and stats["disk"].hit_tokens == 4
    assert stats["disk"].bytes_loaded == _block(7).numel() * 2


def test_the_publisher_sends_each_events_medium():
    from pdserve.shared.engine.block_pool import KVCacheEvent
    from pdserve.shared.worker.kv_publisher import KVEventPublisher

    pub = KVEventPublisher(None, None, "d0", None)
    pub.record([KVCacheEvent("stored", [_h(1)]), KVCacheEvent("removed", [_h(2)], None, "disk")])
    assert [(e.kind, e.medium) for e in pub._pending] == [("stored", "device"), ("removed", "disk")]


def test_admission_gate_writes_a_block_only_once_it_was_seen_twice_and_counts_the_skips(tmp_path):
    # vLLM's store_threshold: a block looked up once is dropped at eviction (counted), twice is written down
    device = {7: _block(7), 8: _block(8)}
    manager = KVOffloadManager(CPUTier(4), None, device.__getitem__, {}.__setitem__, 4, store_threshold=2,
                               tracker_size=2)
    manager.note_seen([_h(1), _h(2)])
    manager.offload(_h(1), 7)
    assert manager.tier_of(_h(1)) is None and manager.tier_stats()["cpu"].stores_skipped == 1
    manager.note_seen([_h(1)])
    manager.offload(_h(1), 7)
    assert manager.tier_of(_h(1)) == "cpu" and manager.tier_stats()["cpu"].bytes_written > 0
    manager.note_seen([_h(3), _h(2)])  # the tracker keeps 2 hashes: 1 (least recent) is forgotten
    assert list(manager.seen) == [_h(3), _h(2)]
    manager.offload(_h(2), 8)
    assert manager.tier_of(_h(2)) == "cpu"
    # a disk tier alone takes the pool's evictions directly, so it counts the skips
    alone = KVOffloadManager(CPUTier(0), _disk(tmp_path), device.__getitem__, {}.__setitem__, 4, store_threshold=2)
    alone.offload(_h(5), 7)
    assert alone.tier_of(_h(5)) is None and alone.tier_stats()["disk"].stores_skipped == 1
    # off (the default): every evicted block is written and nothing is tracked
    default = KVOffloadManager(CPUTier(4), None, device.__getitem__, {}.__setitem__, 4)
    default.note_seen([_h(6)])
    default.offload(_h(6), 7)
    assert default.tier_of(_h(6)) == "cpu" and not default.seen


def test_through_the_cache_manager_a_prompt_is_written_down_at_its_eviction_only_once_a_second_request_saw_it():
    from pdserve.shared.engine.kv_cache_manager import KVCacheManager
    from pdserve.shared.engine.request import Request
    from pdserve.shared.protocol.sampling_params import SamplingParams

    kv = KVCacheManager(8, 4)  # 7 usable blocks
    manager = KVOffloadManager(CPUTier(16), None, lambda block_id: _block(block_id), {}.__setitem__, 4,
                               store_threshold=2)
    kv.set_offload(manager)

    def serve(rid: str, tokens: list[int], kind: str = "new") -> list[bytes]:
        request = Request(rid, tokens, SamplingParams(max_tokens=4), 4, frozenset())
        computed, num_computed = kv.get_computed_blocks(request)
        assert kv.allocate_slots(request, request.num_tokens - num_computed, computed) is not None
        kv.record_prefix_cache_stats(request, num_computed, kind)
        kv.free(request)
        return request.update_block_hashes(4)

    prompt = list(range(10))  # 2 full blocks
    hashes = serve("a", prompt)
    serve("filler1", list(range(100, 128)))  # 7 blocks: evicts a's
    assert [manager.tier_of(h) for h in hashes] == [None, None]
    assert manager.tier_stats()["cpu"].stores_skipped == 2
    serve("a-preempted", prompt, "preempted")  # a preempted request looked up again is not a reuse
    serve("filler2", list(range(200, 228)))
    assert [manager.tier_of(h) for h in hashes] == [None, None]
    serve("a-again", prompt)  # the second request that looks the prompt up
    serve("filler3", list(range(300, 328)))
    assert [manager.tier_of(h) for h in hashes] == ["cpu", "cpu"]
