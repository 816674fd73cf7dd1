"""Tensor parallelism end to end: ``pdserve up`` with a TP=1 prefill pod and two TP=3 decode pods (the
default model's 3 KV heads, one per rank), real processes throughout, driven with the ``openai`` client.

- The KV blocks a TP=1 prefill pod computed reach a TP=3 decode pod (each rank keeps its KV head) and the greedy
  text, streamed and not, equals the offline single-process engine's in fp32.
- SIGKILL of one rank of the decode pod that is generating: the pod exits within seconds naming the dead rank
  (no hang on a collective), ``pdserve up`` restarts it, and the stream moves to the other decode pod and ends
  with the uninterrupted run's text.

The reverse direction (TP=3 prefill to TP=1 decode) runs here too when ``PDSERVE_TEST_TP_REVERSE=1``: CI runs
one direction to keep the suite's time (tests/README.md, "Tensor parallelism end to end").
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from pdserve.loadtest.cluster import Cluster
from support.ensemble import stream_completion

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REVERSE = os.environ.get("PDSERVE_TEST_TP_REVERSE") == "1"
PREFILL_TP, DECODE_TP = (3, 1) if REVERSE else (1, 3)
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe and one city on each."}]
STORY = "Write a long story about a lighthouse keeper and the sea."


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up")
    with Cluster("--prefill", "1", "--decode", "2", "--dtype", "float32",
                 "--prefill-tensor-parallel-size", str(PREFILL_TP), "--decode-tensor-parallel-size", str(DECODE_TP),
                 log_dir=log_dir, env={"PDSERVE_POD_TTL_S": "4", "PDSERVE_MIGRATION_STALL_S": "1"},
                 process=True) as ens:
        yield ens


@pytest.fixture(scope="module")
def offline():
    from pdserve import LLM

    return LLM(MODEL, dtype="float32")


def pod_procs(ensemble: Cluster, pod_id: str) -> tuple[psutil.Process, list[psutil.Process]]:
    """``(worker, its TP rank processes)`` of pod ``pod_id``: the ranks are forked from the worker, so they share
    its environment and command line; the worker is the one whose parent is not of the pod."""
    mine = []
    for proc in psutil.Process(ensemble.proc.pid).children(recursive=True):
        try:
            if proc.environ().get("PDSERVE_POD_ID") == pod_id:
                mine.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    pids = {p.pid for p in mine}
    (worker,) = [p for p in mine if p.ppid() not in pids]
    return worker, [p for p in mine if p.ppid() == worker.pid]


def test_greedy_across_tp_sizes_equals_offline_engine(ensemble, offline, tokenizer):
    from pdserve import SamplingParams

    for pod in ensemble.pods("decode"):
        assert ensemble.stats(pod)["tensor_parallel_size"] == DECODE_TP
    (prefill,) = ensemble.pods("prefill")
    assert ensemble.stats(prefill)["tensor_parallel_size"] == PREFILL_TP
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    want = offline.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    received = sum(ensemble.stats(p)["kv_blocks_received"] for p in ensemble.pods("decode"))

    client = openai.OpenAI(base_url=f"{ensemble.router_url}/v1", api_key="unused", max_retries=0, timeout=600)
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    assert full.choices[0].message.content == want.text
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), len(want.token_ids))
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    # the prompt's blocks crossed the wire from the prefill pod (not recomputed on the decode pod); the second
    # request's may be a prefix hit there, so only the first's are counted on
    blocks = -(-len(prompt_ids) // 16)
    assert sum(ensemble.stats(p)["kv_blocks_received"] for p in ensemble.pods("decode")) - received >= blocks


@pytest.mark.skipif(REVERSE, reason="the decode pods are TP=1 in the reverse run: no rank to kill")
def test_a_killed_rank_ends_its_pod_and_the_stream_moves(ensemble, offline):
    from pdserve import SamplingParams

    body = {"model": MODEL, "prompt": STORY, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    want = offline.generate([STORY], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].outputs[0]
    victim: dict = {}

    def kill_once(text: str) -> None:
        if victim or len(text) < 20:
            return
        busy = [p for p in ensemble.pods("decode") if ensemble.stats(p)["num_running"] > 0]
        assert len(busy) == 1
        worker, ranks = pod_procs(ensemble, busy[0]["pod_id"])
        assert len(ranks) == DECODE_TP - 1
        victim.update(busy[0], worker=worker, rank=ranks[-1], others=ranks[:-1])
        killed_at = time.monotonic()
        os.kill(ranks[-1].pid, signal.SIGKILL)
        threading.Thread(target=lambda: (worker.wait(timeout=60), victim.update(exit_s=time.monotonic() - killed_at)),
                         daemon=True).start()

    got, finish = stream_completion(ensemble, body, kill_once, timeout_s=600)
    assert victim and got == want.text and finish == "length"
    # the pod exited on its own (the rank watchdog), in seconds, with the dead rank named in its log, and took its
    # other ranks with it (no orphan left blocked in a collective)
    gone, alive = psutil.wait_procs([victim["worker"], *victim["others"]], timeout=10)
    assert alive == [], alive
    assert victim["exit_s"] < 10, victim["exit_s"]
    log = (ensemble.log_dir / f"{victim['pod_id']}.log").read_text()
    assert f"tensor-parallel rank {DECODE_TP - 1} of {DECODE_TP} (pid {victim['rank'].pid}) exited with code -9" in log
    up_out = (ensemble.log_dir / "up.out").read_text()
    assert f"pdserve up: {victim['pod_id']} exited with status 3; restarting it in 1 s" in up_out
