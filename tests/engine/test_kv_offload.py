"""KV offloading tiers (docs/engine.md "KV offloading tiers"): a prefix whose blocks the pool evicted comes back
from the CPU tier or the disk tier, and the output is the same as when it was computed fresh.

Oracles: the same engine computing the prompt fresh (greedy tokens equal, logprobs within float noise of a
different prefill split) and hitting the same blocks in the device pool (tokens and logprobs bit-identical: a
loaded block must hold exactly the KV that was evicted). One fp32 model for the module; each test installs its
own tiers on it (``KVCacheManager.set_offload``), and the restart test starts a second engine on the disk tier.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.shared.engine.kv_offload import build_offload

pytestmark = pytest.mark.slow

BLOCKS = 16  # 15 usable blocks of 16 tokens: two 120-token fillers evict everything else
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
FILL = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=BLOCKS, max_model_len=160,
               kv_offloading_size=0.01, kv_offloading_disk_path=str(tmp_path_factory.mktemp("kv-disk")))


def _install(llm: LLM, disk_path, cpu_gib: float = 0.01):
    """Fresh tiers on ``llm`` (an empty device prefix cache, an empty CPU tier, ``disk_path`` indexed)."""
    engine = llm.llm_engine
    assert engine.reset_prefix_cache()
    config = dataclasses.replace(engine.config, kv_offloading_size=cpu_gib,
                                 kv_offloading_disk_path=str(disk_path) if disk_path else None)
    engine.offload = build_offload(config, engine.model_dir, engine.kv_spec, engine.kv_cache)
    engine.kv_manager.set_offload(engine.offload)
    return engine.offload


def _evict_from_pool(llm: LLM, prompt: list[int], salt: str | None = None) -> None:
    for k in range(2):
        llm.generate([list(range(2000 + 300 * k, 2120 + 300 * k))], FILL)
    hashes = _hashes(llm, prompt, salt)
    pool = llm.llm_engine.kv_manager.block_pool
    assert all(pool.get_cached_block(h) is None for h in hashes), "precondition: the prompt left the pool"


def _hashes(llm: LLM, prompt: list[int], salt: str | None = None):
    from pdserve.shared.protocol.block_hash import compute_block_hashes

    return compute_block_hashes(prompt, llm.llm_engine.kv_spec.block_size, salt)


def _run(llm: LLM, prompt: list[int]):
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def _fresh_and_device_hit(llm: LLM, prompt: list[int]):
    fresh = _run(llm, prompt)
    device_hit = _run(llm, prompt)
    assert llm.get_stats().prefix_cache_hits > 0
    return fresh, device_hit


def _assert_same(got, fresh, device_hit):
    assert got[0] == fresh[0]
    assert got == device_hit  # the loaded KV is bit-identical to what was evicted
    assert max(abs(a - b) for a, b in zip(got[1], fresh[1])) < 1e-4


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_prefix_loaded_back_from_a_tier_gives_the_fresh_output(llm, prompt_of, tmp_path, tier):
    offload = _install(llm, tmp_path if tier == "disk" else None, cpu_gib=0.01 if tier == "cpu" else 0)
    prompt = prompt_of(70)  # 4 full blocks, all of them hits when cached
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    assert all(offload.tier_of(h) == tier for h in _hashes(llm, prompt))
    before = llm.get_stats()
    got = _run(llm, prompt)
    stats = llm.get_stats()
    _assert_same(got, fresh, device_hit)
    assert stats.offload[tier].hit_tokens - before.offload[tier].hit_tokens == 64
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 64
    assert stats.prompt_tokens_computed - before.prompt_tokens_computed == 6
    assert stats.offload[tier].bytes_loaded == 4 * llm.llm_engine.kv_spec.bytes_per_block


def test_cpu_evictions_go_to_disk_and_both_tiers_load(llm, prompt_of, tmp_path):
    bpb = llm.llm_engine.kv_spec.bytes_per_block
    offload = _install(llm, tmp_path, cpu_gib=2 * bpb / 2**30)  # the CPU tier holds 2 blocks
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    # tails are evicted first, so the CPU tier's LRU pushed them on to disk; the heads are still in CPU memory
    assert [offload.tier_of(h) for h in _hashes(llm, prompt)] == ["cpu", "cpu", "disk", "disk"]
    assert llm.get_stats().offload["cpu"].evictions > 0
    before = llm.get_stats()
    _assert_same(_run(llm, prompt), fresh, device_hit)
    stats = llm.get_stats()
    cpu, disk = (stats.offload[t].hit_tokens - before.offload[t].hit_tokens for t in ("cpu", "disk"))
    # loading a block evicts another from the pool into the CPU tier, which may push the next one to disk
    assert cpu >= 16 and disk >= 32 and cpu + disk == 64


def test_torn_and_bit_flipped_files_are_skipped_counted_and_output_stays_exact(llm, prompt_of, tmp_path):
    offload = _install(llm, tmp_path, cpu_gib=0)
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    hashes = _hashes(llm, prompt)
    with open(tmp_path / (hashes[1].hex() + ".kv"), "r+b") as f:  # bit flip in the payload
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    path = tmp_path / (hashes[3].hex() + ".kv")
    os.truncate(path, os.path.getsize(path) // 2)  # torn
    got = _run(llm, prompt)
    stats = llm.get_stats()
    assert got[0] == fresh[0]
    assert max(abs(a - b) for a, b in zip(got[1], fresh[1])) < 1e-4
    assert stats.offload["disk"].bad_files == 1  # the flipped block ends the hit; block 3 is never read
    assert stats.offload["disk"].blocks_loaded == 1
    assert offload.tier_of(hashes[1]) is None and not os.path.exists(tmp_path / (hashes[1].hex() + ".kv"))
    # a restarted tier sees the torn file at once (its length disagrees with its header)
    _install(llm, tmp_path, cpu_gib=0)
    assert llm.get_stats().offload["disk"].bad_files == 1


def test_two_salts_never_share_a_block_in_any_tier(llm, prompt_of, tmp_path):
    offload = _install(llm, tmp_path, cpu_gib=2 * llm.llm_engine.kv_spec.bytes_per_block / 2**30)
    prompt = prompt_of(70)
    engine = llm.llm_engine
    engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    _evict_from_pool(llm, prompt, "tenant-a")
    assert None not in {offload.tier_of(h) for h in _hashes(llm, prompt, "tenant-a")}
    assert {offload.tier_of(h) for h in _hashes(llm, prompt, "tenant-b")} == {None}
    before = llm.get_stats()
    engine.add_request("b", prompt, GREEDY, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        engine.step()
    stats = llm.get_stats()
    assert stats.prefix_cache_hits == before.prefix_cache_hits
    assert stats.offload["disk"].blocks_loaded == before.offload["disk"].blocks_loaded


def test_a_restarted_engine_indexes_its_disk_tier_and_loads_from_it(llm, prompt_of, tmp_path):
    _install(llm, tmp_path, cpu_gib=0)
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    restarted = LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=BLOCKS, max_model_len=160,
                    kv_offloading_disk_path=str(tmp_path), enable_kv_events=True)
    engine = restarted.llm_engine
    stored = {h for e in engine.kv_events() if e.kind == "stored" and e.medium == "disk" for h in e.block_hashes}
    assert set(_hashes(llm, prompt)) <= stored  # re-announced on start
    got = _run(restarted, prompt)
    _assert_same(got, fresh, device_hit)
    assert restarted.get_stats().offload["disk"].hit_tokens == 64



def test_a_request_loading_from_a_slow_disk_waits_while_the_batch_keeps_decoding(llm, prompt_of, tmp_path,
                                                                                 monkeypatch):
    """Loads overlap the step: a disk tier held back by a gate (a hook on its file read) keeps one request out of
    the batch while another decodes a token each step; once the gate opens, the loaded prefix gives the fresh
    output."""
    import threading

    offload = _install(llm, tmp_path, cpu_gib=0)
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    entered, gate = threading.Event(), threading.Event()
    read = offload.disk.read

    def slow_read(block_hash):
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return read(block_hash)

    monkeypatch.setattr(offload.disk, "read", slow_read)
    engine = llm.llm_engine
    engine.add_request("runner", prompt_of(20)[::-1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # the runner's prefill
    engine.add_request("loader", prompt, GREEDY)
    runner_tokens = []
    for _ in range(5):
        for out in engine.step():
            assert out.request_id == "runner", "the loading request ran before its blocks arrived"
            runner_tokens.append(len(out.outputs[0].token_ids))
    assert entered.is_set() and runner_tokens == [2, 3, 4, 5, 6]  # one token per step, loads notwithstanding
    assert [r.request_id for r in engine.scheduler.running] == ["runner"]
    gate.set()
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    got = outputs["loader"].outputs[0]
    _assert_same((got.token_ids, [lp[t].logprob for t, lp in zip(got.token_ids, got.logprobs)]), fresh, device_hit)
    assert llm.get_stats().offload["disk"].hit_tokens == 64
    assert engine.kv_manager.loads.num_loads == 1 and not engine.kv_manager.loads


class _EngineReceiver:
    """The decode pod's side of the KV connector over a real engine (what ``DecodeReceiver`` does, minus the
    worker): reserve, write the blocks, commit, release."""

    def __init__(self, engine, layout) -> None:
        self.engine = engine
        self.layout = layout
        self.received_blocks = 0

    async def reserve(self, msg):
        from pdserve.shared.transport import ReserveReply

        result = self.engine.reserve(msg.request_id, msg.prompt_token_ids, msg.cache_salt)
        return ReserveReply(ok=result is not None, num_cached_blocks=result[1] if result else 0)

    async def receive_blocks(self, request_id, first_block_index, blocks):
        self.engine.write_kv(request_id, first_block_index, blocks)
        self.received_blocks += blocks.shape[0]

    async def commit(self, msg):
        from pdserve.shared.transport import CommitReply

        self.engine.commit(msg.request_id, msg.first_token_id, msg.sampling_params, prompt=None)
        return CommitReply(ok=True)

    async def release(self, request_id):
        self.engine.release_reservation(request_id)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_the_hand_over_sends_only_the_blocks_the_decode_pod_holds_in_no_tier(llm, prompt_of, tmp_path, tier):
    """Prefill → decode through the loopback connector and the prefill pod's own ``KVHandover``: the decode pod's
    reservation finds the prompt's first 4 blocks in its ``tier`` (loading them back while the 5th crosses the
    wire), so only the 5th is sent, and the decode output equals the prompt computed fresh."""
    import asyncio

    from pdserve.services.prefill.handover import KVHandover
    from pdserve.shared.protocol.messages import PrefillRequest
    from pdserve.shared.transport.connector import KVConnectorFactory
    from pdserve.shared.transport.layout import KVLayout
    from pdserve.shared.transport.pool import KVClientPool
    from pdserve.shared.worker.metrics import WorkerMetrics

    offload = _install(llm, tmp_path if tier == "disk" else None, cpu_gib=0.01 if tier == "cpu" else 0)
    prompt = prompt_of(70)  # 5 blocks of KV: 4 full ones (hashed, shareable) and a partial one
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    engine = llm.llm_engine
    engine.add_request("p", prompt, GREEDY, prefill_only=True)  # the prefill pod's side: a device hit, parked
    first = engine.step()[0].outputs[0].token_ids[0]
    hashes, kv = engine.take_exports()["p"]
    _evict_from_pool(llm, prompt)
    assert [offload.tier_of(bytes.fromhex(h)) for h in hashes] == [tier] * 4

    spec = engine.kv_spec
    layout = KVLayout(spec.block_size, "float32", spec.num_layers, spec.num_kv_heads, spec.head_dim,
                      "smollm2-135m-instruct")
    connector = KVConnectorFactory.create_connector('{"kv_connector": "loopback"}')
    receiver = _EngineReceiver(engine, layout)
    metrics = WorkerMetrics("prefill", f"prefill-{tier}")

    async def hand_over():
        server = connector.receiver_server(receiver, "s3cret-0123456789", "127.0.0.1", 0)
        await server.start()
        senders = KVClientPool(layout, "s3cret-0123456789", client_class=connector.client_class)
        try:
            handover = KVHandover(connector, senders, metrics, lambda rid: True)
            req = PrefillRequest("d", "smollm2-135m-instruct", prompt, GREEDY, "decode-0", "127.0.0.1",
                                 connector.pod_fields(server)["kv_port"], arrival_time=0.0)
            return await handover.hand_over(req, first, None, hashes, kv)
        finally:
            await senders.close()
            await server.stop()

    before = llm.get_stats()
    assert asyncio.run(hand_over())
    assert receiver.received_blocks == 1 and metrics.kv_transfer_blocks_skipped._value.get() == 4
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    stats = llm.get_stats()  # the reservation's load ran on the loader thread: counted once it is in
    assert stats.offload[tier].hit_tokens - before.offload[tier].hit_tokens == 64
    got = outputs["d"].outputs[0].token_ids
    assert [first, *got[1:]] == fresh[0] and got == device_hit[0]


def test_a_prefill_pods_shared_prompt_comes_back_from_its_tier_not_recomputed(llm, prompt_of, tmp_path):
    """A prefill-only request (the prefill pod's path) whose system prompt the pool evicted loads it back from the
    CPU tier: only the uncached tail is computed; the KV it exports is bit-identical to the first export in the
    full blocks and within float noise (another prefill split) in the 6 computed slots of the partial one."""
    _install(llm, None, cpu_gib=0.01)
    engine = llm.llm_engine
    prompt = prompt_of(70)

    def prefill(rid):
        engine.add_request(rid, prompt, GREEDY, prefill_only=True)
        while rid not in engine.prefill_export:
            engine.step()
        return engine.take_exports()[rid]

    hashes, first = prefill("p1")
    _evict_from_pool(llm, prompt)
    before = llm.get_stats()
    again_hashes, again = prefill("p2")
    stats = llm.get_stats()
    assert again_hashes == hashes and torch.equal(again[:4], first[:4])
    assert torch.allclose(again[4, :, :, :6], first[4, :, :, :6], atol=1e-4)
    assert stats.offload["cpu"].hit_tokens - before.offload["cpu"].hit_tokens == 64
    assert stats.prompt_tokens_computed - before.prompt_tokens_computed == 6


def _export(engine, prompt):
    """The prefill pod's side on the same engine: (first token, the KV of the prompt's 5 blocks)."""
    engine.add_request("p", prompt, GREEDY, prefill_only=True)
    first = engine.step()[0].outputs[0].token_ids[0]
    _, kv = engine.take_exports()["p"]
    return first, kv


def _gate_disk_reads(offload, monkeypatch):
    """A test hook on the disk tier's file read: every read waits for the returned event."""
    import threading

    entered, gate = threading.Event(), threading.Event()
    read = offload.disk.read

    def slow_read(block_hash):
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return read(block_hash)

    monkeypatch.setattr(offload.disk, "read", slow_read)
    return entered, gate


def _drain(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs


def _assert_handed_over_output(out, first, fresh, device_hit):
    """A hand-over's output: the prefill pod's first token, then the decode pod's, equal to the prompt computed
    fresh and to a device hit (tokens; logprobs within float noise: other batch neighbours, another split)."""
    tokens = out.token_ids
    lps = [lp[t].logprob for t, lp in zip(tokens[1:], out.logprobs[-(len(tokens) - 1):])]  # the first is not here
    assert len(lps) == len(tokens) - 1 and [first, *tokens[1:]] == fresh[0] and tokens == device_hit[0]
    assert max(abs(a - b) for a, b in zip(lps, fresh[1][1:])) < 1e-4


def test_a_reservation_loading_from_a_slow_disk_answers_at_once_and_the_batch_keeps_decoding(llm, prompt_of,
                                                                                             tmp_path, monkeypatch):
    """The decode pod's reservation for a hand-over whose prefix is on disk: it answers before the (held back)
    load with the 4 tier blocks counted as cached, the commit returns, and a running request gets a token every
    step while the handed-over request waits out of the batch; once the load is in, the output is exact."""
    offload = _install(llm, tmp_path, cpu_gib=0)
    engine = llm.llm_engine
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    first, kv = _export(engine, prompt)
    _evict_from_pool(llm, prompt)
    entered, gate = _gate_disk_reads(offload, monkeypatch)
    engine.add_request("runner", prompt_of(20)[::-1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # the runner's prefill
    assert engine.reserve("d", prompt) == (5, 4)  # answered with the load held back: the sender sends 1 block
    assert entered.wait(10) and engine.kv_manager.finish_load("d") is None
    engine.write_kv("d", 4, kv[4:])
    engine.commit("d", first, GREEDY)
    runner_tokens = []
    for _ in range(5):
        for out in engine.step():
            assert out.request_id == "runner", "the handed-over request ran before its blocks arrived"
            runner_tokens.append(len(out.outputs[0].token_ids))
    assert runner_tokens == [2, 3, 4, 5, 6]  # one token per step while the load is held back
    assert [r.request_id for r in engine.scheduler.running] == ["runner"]
    gate.set()
    outputs = _drain(engine)
    _assert_handed_over_output(outputs["d"].outputs[0], first, fresh, device_hit)
    assert llm.get_stats().offload["disk"].hit_tokens == 64
    assert not engine.kv_manager.loads and not engine.decode_import.loading


@pytest.mark.parametrize("tiers", ["cpu", "disk", "cpu+disk"])
def test_a_hand_over_whose_prefix_comes_from_the_tiers_equals_the_fresh_output(llm, prompt_of, tmp_path, tiers):
    """Reserve, receive the one block no tier holds, commit: the 4 blocks loaded from the CPU tier, the disk tier
    or both (a CPU tier of 2 blocks pushed the tails on to disk) give the fresh output."""
    bpb = llm.llm_engine.kv_spec.bytes_per_block
    cpu_gib = {"cpu": 0.01, "disk": 0, "cpu+disk": 2 * bpb / 2**30}[tiers]
    offload = _install(llm, None if tiers == "cpu" else tmp_path, cpu_gib=cpu_gib)
    engine = llm.llm_engine
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    first, kv = _export(engine, prompt)
    _evict_from_pool(llm, prompt)
    expected = {"cpu": ["cpu"] * 4, "disk": ["disk"] * 4, "cpu+disk": ["cpu", "cpu", "disk", "disk"]}[tiers]
    assert [offload.tier_of(h) for h in _hashes(llm, prompt)] == expected
    before = llm.get_stats()
    assert engine.reserve("d", prompt) == (5, 4)
    engine.write_kv("d", 4, kv[4:])
    engine.commit("d", first, GREEDY)
    outputs = _drain(engine)
    _assert_handed_over_output(outputs["d"].outputs[0], first, fresh, device_hit)
    stats = llm.get_stats()
    hit = {t: stats.offload[t].hit_tokens - before.offload[t].hit_tokens for t in ("cpu", "disk")}
    assert sum(hit.values()) == 64 and (tiers != "cpu+disk" or (hit["cpu"] >= 16 and hit["disk"] >= 16))
    assert stats.prompt_tokens_computed == before.prompt_tokens_computed  # nothing recomputed on the decode side


def _reserve_and_let_the_lease_expire(engine, prompt) -> None:
    """A prefill pod that reserves over TCP and sends nothing: the KV-transfer server's lease expires and it
    releases the reservation (``DecodeReceiver.release``, here ``_EngineReceiver``)."""
    import asyncio

    from pdserve.shared.transport import KVLayout, KVTransferClient, KVTransferServer, Reserve

    spec = engine.kv_spec
    layout = KVLayout(spec.block_size, "float32", spec.num_layers, spec.num_kv_heads, spec.head_dim,
                      "smollm2-135m-instruct")

    async def go():
        server = KVTransferServer(_EngineReceiver(engine, layout), "s3cret-0123456789", host="127.0.0.1", port=0,
                                  lease_ttl_s=0.3)
        await server.start()
        try:
            async with KVTransferClient("127.0.0.1", server.port, layout, "s3cret-0123456789") as client:
                reply = await client.reserve(Reserve("d", prompt, len(prompt), [], None))
                assert reply.ok and reply.num_cached_blocks == 4
                for _ in range(500):
                    if "d" not in engine.decode_import:
                        break
                    await asyncio.sleep(0.01)
                assert server.leases_expired == 1
        finally:
            await server.stop()

    asyncio.run(go())


@pytest.mark.parametrize("fault", ["release", "lease expiry", "abort after commit", "finished by its first token"])
def test_a_hand_over_given_up_while_its_tier_load_runs_returns_every_block(llm, prompt_of, tmp_path, monkeypatch,
                                                                          caplog, fault):
    """``release``: what an ``Abort`` frame or a dropped connection does before the commit
    (``DecodeReceiver.release``); ``lease expiry``: the same through the KV-transfer server's lease timer;
    ``abort after commit``: the client went away while the committed request waited
    for its load. The blocks the loader writes stay pinned until it is done, then every block is back in the
    pool (the loaded ones kept in the prefix cache), nothing is left loading, and nothing is logged beyond the expiry."""
    import logging

    offload = _install(llm, tmp_path, cpu_gib=0)
    engine = llm.llm_engine
    prompt = prompt_of(70)
    first, kv = _export(engine, prompt)
    _evict_from_pool(llm, prompt)
    _, gate = _gate_disk_reads(offload, monkeypatch)
    free_before = engine.kv_manager.num_free_blocks
    caplog.set_level(logging.WARNING, logger="pdserve")
    if fault == "lease expiry":
        _reserve_and_let_the_lease_expire(engine, prompt)
    elif fault == "release":
        assert engine.reserve("d", prompt) == (5, 4)
        engine.release_reservation("d")
    else:
        assert engine.reserve("d", prompt) == (5, 4)
        engine.write_kv("d", 4, kv[4:])
        params = GREEDY if fault == "abort after commit" else SamplingParams(temperature=0, max_tokens=1)
        engine.commit("d", first, params)
        if fault == "abort after commit":
            assert engine.decode_import.loading and engine.abort_request("d")
        else:  # finished at its commit (its blocks freed there); its output state is dropped by the abort
            assert not engine.decode_import.loading and engine.abort_request("d")
    assert not engine.owns("d")
    assert engine.kv_manager.num_free_blocks == free_before - 4  # the loader may still be writing these
    assert not engine.has_unfinished_requests() and not engine.decode_import.loading
    gate.set()
    engine.kv_manager.loads.wait_any(10)
    engine.step()  # an empty step reaps the finished load
    assert engine.kv_manager.num_free_blocks == free_before
    assert not engine.kv_manager.loads and not engine.kv_manager.loads.finished and not engine.decode_import.tier_blocks
    assert all(engine.kv_manager.block_pool.get_cached_block(h) is not None for h in _hashes(llm, prompt)[:4])
    expected = "expired after" if fault == "lease expiry" else None  # the server's warning about the lease itself
    assert [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and not (expected and expected in r.getMessage())] == []


def test_a_bad_disk_file_met_by_a_reservations_load_is_recomputed_on_the_decode_pod(llm, prompt_of, tmp_path):
    """The reservation counted block 1's file as cached, but it fails its checksum when loaded: the request joins
    the batch with its tokens from block 1 on to compute (the received block included), and the output is exact."""
    _install(llm, tmp_path, cpu_gib=0)
    engine = llm.llm_engine
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    first, kv = _export(engine, prompt)
    _evict_from_pool(llm, prompt)
    with open(tmp_path / (_hashes(llm, prompt)[1].hex() + ".kv"), "r+b") as f:  # bit flip in the payload
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    before = llm.get_stats()
    assert engine.reserve("d", prompt) == (5, 4)
    engine.write_kv("d", 4, kv[4:])
    engine.commit("d", first, GREEDY)
    out = _drain(engine)["d"].outputs[0]
    stats = llm.get_stats()
    assert [first, *out.token_ids[1:]] == fresh[0]
    lps = [lp[t].logprob for t, lp in zip(out.token_ids[1:], out.logprobs[-(len(out.token_ids) - 1):])]
    assert max(abs(a - b) for a, b in zip(lps, fresh[1][1:])) < 1e-4
    assert stats.offload["disk"].bad_files - before.offload["disk"].bad_files == 1
    assert stats.prompt_tokens_computed - before.prompt_tokens_computed == 70 - 16  # from block 1 on
