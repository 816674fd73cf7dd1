"""KV-aware routing end to end: ``pdserve up --prefill 1 --decode 2`` (real redis-server, registry, router and
workers as processes), driven over HTTP.

Oracles: the offline ``LLM`` (greedy, fp32) for every output, whether the prompt's blocks were transferred,
skipped or prefilled locally; the KV layout for the exact bytes a block takes on the wire
(30 layers x K,V x 16 tokens x 3 KV heads x 64 dims x 4 bytes); the decode pods' own transfer counters
(``/v1/stats``) for which pod was chosen and what crossed the wire.
"""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.loadtest.cluster import Cluster

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
BLOCK = 16
BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4
LOCAL_THRESHOLD = 20
TEXT = " ".join(f"Step {i}: mix {i} cups of flour with {3 * i} eggs and bake for {10 + i} minutes." for i in range(90))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    with Cluster("--prefill", "1", "--decode", "2", "--dtype", "float32", "--kv-cache-memory", "256MiB",
                 "--local-prefill-threshold", str(LOCAL_THRESHOLD),
                 log_dir=tmp_path_factory.mktemp("up"), process=True) as ens:
        yield ens


@pytest.fixture(scope="module")
def client(ensemble):
    return openai.OpenAI(base_url=f"{ensemble.router_url}/v1", api_key="unused", max_retries=0, timeout=300)


def received(ensemble) -> dict[str, tuple[int, int]]:
    return {p["pod_id"]: (s["kv_blocks_received"], s["kv_bytes_received"])
            for p in ensemble.pods("decode") for s in [ensemble.stats(p)]}


def delta(before, after) -> dict[str, tuple[int, int]]:
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}


def wait_overlap(ensemble, ids: list[int], pod_id: str, blocks: int, timeout_s: float = 15.0) -> None:
    """Until the registry's lookup shows ``pod_id`` holding the first ``blocks`` blocks of ``ids``."""
    hashes = [h.hex() for h in compute_block_hashes(ids, BLOCK)]
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.post(f"{ensemble.registry_url}/v1/kv/lookup", json={"block_hashes": hashes},
                           headers=ensemble.registry_headers, timeout=5).json()
        overlap = {o["pod"]["pod_id"]: o["overlap"] for o in reply["pods"]}
        if overlap.get(pod_id, 0) >= blocks:
            return
        assert time.monotonic() < deadline, f"registry never showed {blocks} blocks on {pod_id}: {overlap}"
        time.sleep(0.2)


def decisions(ensemble) -> dict[str, float]:
    text = httpx.get(f"{ensemble.router_url}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve:pd_decisions_total{"):
            decision = line.split('decision="')[1].split('"')[0]
            out[decision] = out.get(decision, 0.0) + float(line.rsplit(" ", 1)[1])  # summed over reasons
    return out


def test_prefix_routing_transfers_only_new_blocks_and_prefills_short_suffixes_locally(ensemble, client, tokenizer):
    from pdserve import LLM, SamplingParams

    ids = tokenizer.encode(TEXT)
    assert len(ids) > 900
    prefix = ids[:512]  # 32 full blocks
    p1 = prefix + ids[600:632]  # 34 blocks
    p2 = prefix + ids[700:732]  # the same prefix, a new 32-token suffix
    p3 = p1 + ids[800:808]  # p1 and 8 more tokens: 8 uncached tokens <= threshold
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = LLM(MODEL, dtype="float32", kv_cache_memory_bytes="128MiB")
    want = [o.outputs[0].text for o in offline.generate([p1, p2, p3], params)]
    del offline

    def ask(prompt):
        r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    assert len(ensemble.pods("decode")) == 2
    before = received(ensemble)
    assert ask(p1) == want[0]
    d1 = delta(before, received(ensemble))
    (chosen,) = [k for k, (blocks, _) in d1.items() if blocks]
    other = next(k for k in d1 if k != chosen)
    assert d1[chosen] == (34, 34 * BLOCK_BYTES) and d1[other] == (0, 0)

    # the router sees the prefix on `chosen` and sends the request there; only the 2 new blocks travel
    wait_overlap(ensemble, p2, chosen, 32)
    before = received(ensemble)
    assert ask(p2) == want[1]
    d2 = delta(before, received(ensemble))
    assert d2 == {chosen: (2, 2 * BLOCK_BYTES), other: (0, 0)}

    # 8 uncached tokens on `chosen`: it prefills them itself, nothing crosses the wire
    wait_overlap(ensemble, p3, chosen, 34)
    local_before = decisions(ensemble).get("local", 0)
    before = received(ensemble)
    assert ask(p3) == want[2]
    assert delta(before, received(ensemble)) == {chosen: (0, 0), other: (0, 0)}
    assert decisions(ensemble).get("local", 0) == local_before + 1
    assert decisions(ensemble).get("remote", 0) >= 2
    # the prefill pod accounts for what it skipped: the 32 prefix blocks of p2
    prefill = ensemble.pods("prefill")[0]
    metrics = httpx.get(f"http://{prefill['host']}:{prefill['http_port']}/metrics", timeout=5).text
    skipped = [ln for ln in metrics.splitlines() if ln.startswith("pdserve:kv_transfer_blocks_skipped_total")]
    assert float(skipped[0].rsplit(" ", 1)[1]) == 32
