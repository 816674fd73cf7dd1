"""The local-or-remote prefill decision (``pd_policy.py``; docs/routing.md "How it works", step 6).

Oracle: the estimates written out by hand from the documented formula (r = 1000 tokens/s, B = 2048 tokens per
step), on constructed pod and queue states; then the one policy behind both placement paths, with a real
registry (in-process, real redis-server) carrying the prefill pods' ``queued_prefill_tokens``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import pytest_asyncio

from pdserve.services.router.dispatch import DispatchConfig, Dispatcher, RoutingConfig
from pdserve.services.router.pd_policy import (POLICIES, REASONS, PdPolicy, PolicyConfig, PrefillCase, PrefillTier,
                                               QueueAwarePolicy, ThresholdPolicy, make_policy)
from pdserve.services.router.settings import RouterSettings
from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.shared.protocol.kv_events import KVEvent, KVEventBatch

from support.registry_inprocess import pod, registry_client

CONFIG = PolicyConfig(local_prefill_threshold=0, fallback_max_tokens=256, ttft_slo_ms=2000, tpot_slo_ms=100,
                      prefill_tokens_per_s=1000, step_budget_tokens=2048)
BACKLOG = 8 * 1024  # eight long prompts held by the prefill tier


def decode_pod(running: int = 0, waiting: int = 0, colocated: bool = False) -> SimpleNamespace:
    return SimpleNamespace(pod_id="d0", num_running=running, num_waiting=waiting, colocated=colocated)


def decide(tokens: int, pod, pods: int = 1, queued: int = 0, config: PolicyConfig = CONFIG):
    return QueueAwarePolicy(config).decide(PrefillCase(pod, tokens, PrefillTier(pods, queued)))


def test_a_short_prompt_behind_a_long_backlog_prefills_locally():
    d = decide(64, decode_pod(running=2), queued=BACKLOG)
    assert (d.local, d.reason) == (True, "lower_ttft")
    # TTFT_remote = (8192 / 1 + 64) / 1000; TTFT_local = 64 / (1000 * (2048 - 2) / 2048)
    assert d.estimates == pytest.approx({"remote": 8.256, "local": 64 * 2048 / (1000 * 2046)})


def test_the_same_prompt_goes_remote_when_the_backlog_is_shared_by_enough_prefill_pods():
    # 8192 / 8 + 64 tokens at 1000 tok/s: 1.088 s, within the 2 s TTFT SLO
    d = decide(64, decode_pod(running=2), pods=8, queued=BACKLOG)
    assert (d.local, d.reason) == (False, "ttft_slo_met")


def test_an_idle_prefill_tier_takes_a_long_prompt():
    d = decide(1024, decode_pod())
    assert (d.local, d.reason) == (False, "ttft_slo_met")
    # without a TTFT SLO the estimates tie (1.024 s each way) and remote wins the tie
    d = decide(1024, decode_pod(), config=PolicyConfig(ttft_slo_ms=0, tpot_slo_ms=100))
    assert (d.local, d.reason) == (False, "lower_ttft")
    assert d.estimates == pytest.approx({"remote": 1.024, "local": 1.024})


def test_a_decode_pod_near_its_tpot_slo_gets_no_local_prefill():
    # a step with the prefill chunk: (90 running + 64) / 1000 tok/s = 154 ms > 100 ms
    d = decide(64, decode_pod(running=80, waiting=10), queued=BACKLOG)
    assert (d.local, d.reason) == (False, "tpot_slo")
    assert "154 ms" in d.detail
    # no SLO: the same state goes local (the lower TTFT)
    d = decide(64, decode_pod(running=80, waiting=10), queued=BACKLOG, config=PolicyConfig(tpot_slo_ms=0))
    assert (d.local, d.reason) == (True, "lower_ttft")


def test_without_a_prefill_pod_what_fits_the_fallback_goes_local():
    d = decide(200, decode_pod(running=90), pods=0)  # busy, but nothing else can prefill it
    assert (d.local, d.reason, d.detail) == (True, "no_prefill_pod", "no prefill pod alive")
    d = decide(1024, decode_pod(), pods=0)
    assert (d.local, d.reason) == (False, "no_prefill_pod")


def test_the_threshold_stays_a_floor_and_a_colocated_pod_always_prefills():
    config = PolicyConfig(local_prefill_threshold=128)
    busy = decode_pod(running=500)
    assert (decide(128, busy, config=config).local, decide(128, busy, config=config).reason) == (True, "threshold")
    assert decide(129, busy, config=config).reason == "tpot_slo"
    d = decide(4096, decode_pod(running=500, colocated=True))
    assert (d.local, d.reason) == (True, "colocated")


def test_the_threshold_policy_is_the_rule_before_the_queue_aware_one():
    policy = ThresholdPolicy(PolicyConfig(local_prefill_threshold=40))
    case = PrefillCase(decode_pod(), 64, PrefillTier(1, BACKLOG))
    assert (policy.decide(case).local, policy.decide(case).reason) == (False, "default")
    assert policy.decide(PrefillCase(decode_pod(), 40, PrefillTier(1, BACKLOG))).reason == "threshold"


def test_policies_are_chosen_by_name_and_reasons_are_a_fixed_set():
    assert sorted(POLICIES) == ["queue-aware", "threshold"]
    assert isinstance(make_policy("threshold", CONFIG), ThresholdPolicy)
    with pytest.raises(ValueError, match="unknown pd policy 'fastest'; known: queue-aware, threshold"):
        make_policy("fastest", CONFIG)
    for policy in POLICIES.values():
        p = policy(CONFIG)
        names = [f.name for f in p.filters] + [p.picker.name]
        assert set(names) <= set(REASONS), names
    assert RouterSettings().pd_policy == "queue-aware"


# --- both placement paths ask the one policy, with a real registry ---

PREFIX = list(range(1000, 1512))  # 32 blocks


@pytest_asyncio.fixture
async def registry(redis_url):
    async for client in registry_client(redis_url):
        yield client


class Recording(PdPolicy):
    """The queue-aware policy, keeping every case it was asked about."""

    name = "recording"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        inner = QueueAwarePolicy(config or PolicyConfig())
        super().__init__(inner.filters, inner.scorers, inner.picker)
        self.cases: list[PrefillCase] = []

    def decide(self, case):
        self.cases.append(case)
        return super().decide(case)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["kv", "least_loaded", "round_robin"])
async def test_every_routing_mode_asks_the_policy_with_the_prefill_queue_it_reports(registry, mode):
    await registry.heartbeat(pod("d0", num_running=2))
    # the pod's queue as a prefill pod reports it: eight long prompts, no threshold, a measured 1000 tokens/s
    await registry.heartbeat(pod("p0", role="prefill", queued_prefill_tokens=BACKLOG, queued_long_prefill_tokens=0,
                                 prefill_tokens_per_s=1000.0))
    d = Dispatcher(None, registry, DispatchConfig(cache_s=0.0, routing=RoutingConfig(mode)), rng=random.Random(0))
    d.placer.policy = policy = Recording()
    short = PREFIX[:64]
    placed = await d.place(len(short), short)
    assert (placed.pod.pod_id, placed.local_prefill, placed.why) == ("d0", True, "lower_ttft")
    (case,) = policy.cases
    assert (case.tokens, case.tier, case.pod.num_running) == (64, PrefillTier(1, BACKLOG, 0, 0, 1000.0), 2)
    # the same backlog of long prompts prefilled in chunks of 256, short ones passing them: the short prompt waits
    # for one chunk and goes remote
    await registry.heartbeat(pod("p0", role="prefill", queued_prefill_tokens=BACKLOG,
                                 queued_long_prefill_tokens=BACKLOG, long_prefill_token_threshold=256,
                                 prefill_tokens_per_s=1000.0))
    placed = await d.place(len(short), short)
    assert (placed.local_prefill, placed.why) == (False, "ttft_slo_met")
    assert policy.cases[-1].tier == PrefillTier(1, BACKLOG, BACKLOG, 256, 1000.0)
    # the backlog drains and the decode pod is idle: the long prompt goes to the idle tier
    await registry.heartbeat(pod("d0"))
    await registry.heartbeat(pod("p0", role="prefill", queued_prefill_tokens=0))
    placed = await d.place(len(PREFIX), PREFIX)
    assert (placed.local_prefill, placed.why) == (False, "ttft_slo_met")


@pytest.mark.asyncio
async def test_blocks_in_a_decode_pods_cpu_or_disk_tier_count_as_cached_for_the_decision(registry):
    """A later chat turn whose history the decode pod evicted to its tiers: what it would compute is the suffix past
    every medium's blocks (they load back), so it stays under the threshold and prefills there; counting the pool
    alone sent it to the prefill pod, which never held the previous answer's KV (bench multi-turn)."""
    chain = [h.hex() for h in compute_block_hashes(PREFIX, 16)]  # 32 blocks
    await registry.heartbeat(pod("d0"))
    await registry.heartbeat(pod("p0", role="prefill"))
    await registry.publish_kv_events(KVEventBatch(pod_id="d0", epoch="e", events=[
        KVEvent(seq=1, kind="stored", block_hashes=chain[:8], medium="device"),
        KVEvent(seq=2, kind="stored", block_hashes=chain[8:24], medium="cpu"),
        KVEvent(seq=3, kind="stored", block_hashes=chain[24:28], medium="disk")]))
    d = Dispatcher(None, registry, DispatchConfig(cache_s=0.0, routing=RoutingConfig("kv"),
                                                  local_prefill_threshold=64), rng=random.Random(0))
    d.placer.policy = policy = Recording(PolicyConfig(local_prefill_threshold=64))
    placed = await d.place(len(PREFIX), PREFIX)
    assert policy.cases[-1].tokens == 512 - 28 * 16
    assert (placed.pod.pod_id, placed.local_prefill, placed.why, placed.cached_blocks) == ("d0", True, "threshold", 8)
    # past the disk tier's blocks: 5 blocks to compute, over the threshold
    await registry.publish_kv_events(KVEventBatch(pod_id="d0", epoch="e", events=[
        KVEvent(seq=4, kind="removed", block_hashes=chain[24:28], medium="disk")]))
    placed = await d.place(len(PREFIX), PREFIX)
    assert (policy.cases[-1].tokens, placed.local_prefill) == (512 - 24 * 16, False)


@pytest.mark.asyncio
async def test_the_dispatcher_builds_the_policy_the_settings_name(registry):
    settings = RouterSettings(pd_policy="threshold", local_prefill_threshold=40, ttft_slo_ms=500, tpot_slo_ms=50,
                              prefill_tokens_per_s=4000, max_num_batched_tokens=512)
    config = DispatchConfig.from_settings(settings)
    assert config.policy_config() == PolicyConfig(40, 256, 500, 50, 4000, 512)
    d = Dispatcher(None, registry, config)
    assert isinstance(d.placer.policy, ThresholdPolicy)
    await registry.heartbeat(pod("d0"))
    await registry.heartbeat(pod("p0", role="prefill", queued_prefill_tokens=BACKLOG))
    placed = await d.place(64, PREFIX[:64])
    assert (placed.local_prefill, placed.why) == (False, "default")  # threshold: the backlog does not count
    assert isinstance(Dispatcher(None, registry, DispatchConfig()).placer.policy, QueueAwarePolicy)


def test_a_short_prompt_waits_for_one_chunk_of_the_long_prompts_not_their_whole_prefill():
    # 4 long prompts (4096 tokens) and 2 short ones (128) queued on one prefill pod that prefills long prompts in
    # chunks of 256 tokens: a 64-token prompt waits for the 128 short tokens and one chunk, (128 + 256 + 64) / 1000
    tier = PrefillTier(1, queued_tokens=4096 + 128, queued_long_tokens=4096, long_threshold=256)
    d = QueueAwarePolicy(CONFIG).decide(PrefillCase(decode_pod(running=2), 64, tier))
    assert (d.local, d.reason) == (False, "ttft_slo_met")
    assert d.estimates["remote"] == pytest.approx(0.448)
    # a long prompt waits for everything queued: (4224 + 1024) / 1000
    d = QueueAwarePolicy(CONFIG).decide(PrefillCase(decode_pod(), 1024, tier))
    assert d.estimates["remote"] == pytest.approx(5.248)
    # pods without a threshold (older ones, or 0): FIFO over the whole queue
    flat = PrefillTier(1, queued_tokens=4096 + 128, queued_long_tokens=0, long_threshold=0)
    d = QueueAwarePolicy(CONFIG).decide(PrefillCase(decode_pod(running=2), 64, flat))
    assert (d.local, d.estimates["remote"]) == (True, pytest.approx(4.288))


def test_the_measured_prefill_rate_replaces_the_setting():
    # the pods measured 100 tokens/s (a loaded host), not the 1000 configured: 1024 queued tokens are 10 s, not 1 s
    slow = PrefillTier(1, queued_tokens=1024, tokens_per_s=100.0)
    d = QueueAwarePolicy(CONFIG).decide(PrefillCase(decode_pod(), 64, slow))
    assert (d.local, d.reason) == (True, "lower_ttft")
    assert d.estimates == pytest.approx({"remote": 10.88, "local": 0.64})
    # a busy decode pod's step keeps the configured rate: (2 + 64) / 1000 tok/s = 66 ms, within the 100 ms TPOT SLO
    d = QueueAwarePolicy(CONFIG).decide(PrefillCase(decode_pod(running=2), 64, slow))
    assert (d.local, d.reason) == (True, "lower_ttft")
    tier = PrefillTier.of([SimpleNamespace(queued_prefill_tokens=100, queued_long_prefill_tokens=0,
                                           long_prefill_token_threshold=256, prefill_tokens_per_s=300.0),
                           SimpleNamespace(queued_prefill_tokens=2000, queued_long_prefill_tokens=2000,
                                           long_prefill_token_threshold=256, prefill_tokens_per_s=500.0),
                           SimpleNamespace(queued_prefill_tokens=0)])  # a pod that measured nothing yet
    assert tier == PrefillTier(3, 2100, 2000, 256, 400.0)
