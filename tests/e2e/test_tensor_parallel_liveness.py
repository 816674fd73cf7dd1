"""Issue 24: a tensor-parallel pod under ``pdserve up`` stays up while idle, and comes back when one of its ranks
hangs. A tiny random Llama (6 heads, 3 KV heads: one per rank) at TP=3 keeps the CPU low; real processes
throughout, with ``PDSERVE_TP_TIMEOUT_S`` shortened to 4 s so that "idle for twice the timeout" takes seconds.

- Idle for 2.5 times the timeout, the decode pod is still the same process with the same ranks, and serves the
  offline engine's greedy text (before the fix the ranks gave up waiting for an order: a crash loop every 4 s).
- A rank stopped with SIGSTOP fails the next step after the timeout with ``TPRankDied`` naming it; the pod exits
  (code 3) and ``pdserve up`` restarts it, although the stopped rank would still hold the ports its pod bound
  (before the fix it outlived the pod, and every restart failed with ``address already in use``).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest

from pdserve.loadtest.cluster import Cluster
from support.tiny_llama import make_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TIMEOUT_S = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), model_dir, heads=(6, 3))


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory, tiny):
    with Cluster("--model", tiny, "--colocated", "--decode", "1", "--decode-tensor-parallel-size", "3",
                 "--dtype", "float32", log_dir=tmp_path_factory.mktemp("up"),
                 env={"PDSERVE_TP_TIMEOUT_S": str(TIMEOUT_S), "PDSERVE_POD_TTL_S": "4"}, process=True) as ens:
        yield ens


@pytest.fixture(scope="module")
def body_and_want(tiny):
    from pdserve import LLM, SamplingParams

    prompt = "The lighthouse keeper looked at the sea and"
    want = LLM(tiny, dtype="float32").generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                                         ignore_eos=True))[0].outputs[0].text
    return {"model": tiny, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}, want


def complete(ensemble: Cluster, body: dict, timeout_s: float = 60) -> str:
    resp = httpx.post(f"{ensemble.router_url}/v1/completions", json=body, timeout=timeout_s)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def worker_and_ranks(ensemble: Cluster) -> tuple[psutil.Process, list[psutil.Process]]:
    worker = psutil.Process(ensemble.child_pid("decode", "decode-0"))
    return worker, worker.children()


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_idle_tp3_pod_still_serves_after_twice_the_timeout(ensemble, body_and_want):
    body, want = body_and_want
    assert complete(ensemble, body) == want
    worker, ranks = worker_and_ranks(ensemble)
    assert len(ranks) == 2
    time.sleep(2.5 * TIMEOUT_S)  # no request meanwhile
    assert worker_and_ranks(ensemble) == (worker, ranks)
    assert all(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)
    assert complete(ensemble, body) == want
    assert "restarting" not in (ensemble.log_dir / "up.out").read_text()


def test_a_stopped_rank_fails_its_pod_and_the_restart_is_not_blocked_by_it(ensemble, body_and_want):
    body, want = body_and_want
    worker, ranks = worker_and_ranks(ensemble)
    url = re.search(r"decode-0\s+(http://\S+)", (ensemble.log_dir / "up.out").read_text()).group(1) + "/health"
    os.kill(ranks[0].pid, signal.SIGSTOP)
    try:
        # the step this request starts waits on the stopped rank: it fails after the timeout and the pod exits
        threading.Thread(target=lambda: httpx.post(f"{ensemble.router_url}/v1/completions", json=body, timeout=60),
                         daemon=True).start()
        worker.wait(timeout=TIMEOUT_S + 60)
        log = (ensemble.log_dir / "decode-0.log").read_text()
        assert (f"tensor-parallel rank 1 of 3 (pid {ranks[0].pid}) is stopped and did not answer within "
                f"PDSERVE_TP_TIMEOUT_S ({TIMEOUT_S} s)") in log
        # pdserve up restarts the pod, and the stopped rank goes with its predecessor rather than block it
        deadline = time.monotonic() + 240
        while not (ensemble.find_child_pid("decode", "decode-0") not in (None, worker.pid) and healthy(url)):
            assert time.monotonic() < deadline, (ensemble.log_dir / "up.out").read_text()[-3000:]
            time.sleep(0.5)
        up_out = (ensemble.log_dir / "up.out").read_text()
        assert "decode-0 exited with status 3; restarting it in 1 s" in up_out
        assert not psutil.pid_exists(ranks[0].pid) or ranks[0].status() == psutil.STATUS_ZOMBIE
        assert complete(ensemble, body, timeout_s=120) == want
        assert "address already in use" not in (ensemble.log_dir / "decode-0.log").read_text()
    finally:
        for rank in ranks:  # never leave a stopped process behind, whatever failed
            try:
                rank.kill()
            except psutil.NoSuchProcess:
                pass
