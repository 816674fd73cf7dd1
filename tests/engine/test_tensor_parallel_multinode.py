"""Multi-node tensor parallelism: the ranks of one engine in separate OS processes ("nodes") that meet
through the leader's rendezvous over TCP on localhost, as a LeaderWorkerSet's pods do through the leader's address.

Oracles: the single-process engine's greedy tokens on the same random Llama (fp32); the exact one-line errors of a
worker that cannot reach its leader, a leader whose worker node never joins or dies, a worker whose leader dies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.shared.engine.tp_executor import TPRankDied
from support.tiny_llama import make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(100, 131)), list(range(7, 12)), list(range(500, 540))]

# node 0: the engine (as a worker pod runs it, exiting on a rank's death), then idle until killed
LEADER = textwrap.dedent("""
    import json, logging, sys, time
    from pdserve import LLM, SamplingParams
    from pdserve.shared.worker.base import exit_on_rank_death
    logging.basicConfig(level="INFO")
    path, port, tp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, num_kv_blocks=64, tensor_parallel_size=tp, nnodes=2,
              master_port=port, tp_join_timeout_s=120)
    llm.llm_engine.tp.on_death = exit_on_rank_death
    got = llm.generate(json.loads(sys.argv[5]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    with open(out + ".tmp", "w") as f:
        json.dump([o.outputs[0].token_ids for o in got], f)
    import os; os.rename(out + ".tmp", out)
    time.sleep(600)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(port: int, log, timeout_s: float = 120) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "tp-worker", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "--join-timeout-s",
                             str(timeout_s)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _leader(tmp_path, path: str, port: int, tp: int, log) -> subprocess.Popen:
    script = tmp_path / "leader.py"
    script.write_text(LEADER)
    return subprocess.Popen([sys.executable, str(script), path, str(port), str(tp), str(tmp_path / "out.json"),
                             json.dumps(PROMPTS)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_output(tmp_path, procs, timeout: float = 300) -> list[list[int]]:
    deadline = time.monotonic() + timeout
    while not (tmp_path / "out.json").exists():
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        assert time.monotonic() < deadline, "no output from the leader"
        time.sleep(0.2)
    return json.loads((tmp_path / "out.json").read_text())


def _last_line(log_path) -> str:
    return log_path.read_text().strip().splitlines()[-1]


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), model_dir)
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", max_num_batched_tokens=32).generate(PROMPTS, GREEDY)]
    return path, want


@pytest.mark.slow
@pytest.mark.parametrize("tp,killed", [(4, "worker"), (2, "leader")])
def test_leader_and_worker_nodes_give_tp1_greedy_and_fail_fast_when_the_other_dies(tmp_path, tiny, tp, killed):
    # TP=4 over 2 nodes: 2 ranks per node, each of the 2 KV heads replicated on two ranks (one on each node)
    path, want = tiny
    port = _free_port()
    leader_log, worker_log = tmp_path / "leader.log", tmp_path / "worker.log"
    with open(leader_log, "w") as ll, open(worker_log, "w") as wl:
        worker = _worker(port, wl)  # first: it waits for the leader as a LeaderWorkerSet's worker pod may
        leader = _leader(tmp_path, path, port, tp, ll)
        try:
            assert _wait_for_output(tmp_path, [leader, worker]) == want
            victim, survivor = (worker, leader) if killed == "worker" else (leader, worker)
            os.killpg(victim.pid, signal.SIGKILL)  # the whole pod: supervisor and its ranks
            t0 = time.monotonic()
            rc = survivor.wait(timeout=30)
            took = time.monotonic() - t0
        finally:
            _kill(leader, worker)
    if killed == "worker":  # the leader is idle: its watchdog sees the node's heartbeat stop
        assert rc == 3
        assert _last_line(leader_log).endswith(
            "tensor-parallel node 1 of 2 (ranks 2..3 of 4) sent no heartbeat for 5 s; the engine cannot continue "
            "without it: exiting")
    else:
        assert rc == 1
        assert _last_line(worker_log).partition("]: ")[2].startswith(f"lost the tensor-parallel leader at 127.0.0.1:{port}: ")
    assert took < 15


@pytest.mark.slow
def test_a_worker_that_cannot_reach_its_leader_fails_with_one_line(tmp_path):
    port = _free_port()  # nothing listens there
    log = tmp_path / "worker.log"
    with open(log, "w") as f:
        t0 = time.monotonic()
        rc = _worker(port, f, timeout_s=2).wait(timeout=60)
    assert rc == 1
    assert _last_line(log).partition("]: ")[2].startswith(
        f"cannot reach the tensor-parallel leader at 127.0.0.1:{port} within 2 s: ")
    assert time.monotonic() - t0 < 30  # 2 s of trying plus the interpreter's start-up


@pytest.mark.slow
def test_a_leader_whose_worker_node_never_joins_fails_with_one_line(tiny):
    port = _free_port()
    with pytest.raises(TPRankDied) as e:
        LLM(tiny[0], dtype="float32", tensor_parallel_size=2, nnodes=2, master_port=port, tp_join_timeout_s=1)
    assert str(e.value) == (f"tensor-parallel node 1 of 2 did not join the rendezvous on port {port} within 1 s (run "
                            f"`pdserve tp-worker --node-rank 1 --master-addr <this pod's address> --master-port "
                            f"{port}`)")


def test_nnodes_must_divide_the_ranks_and_have_a_rendezvous_port():
    from pdserve.shared.engine.config import EngineConfig

    with pytest.raises(ValueError) as e:
        EngineConfig(tensor_parallel_size=4, nnodes=3, master_port=29500)
    assert str(e.value) == ("tensor_parallel_size (4) must be a multiple of nnodes (3): every node runs the same "
                            "number of ranks")
    with pytest.raises(ValueError) as e:
        EngineConfig(tensor_parallel_size=4, nnodes=2)
    assert str(e.value) == "nnodes=2 needs master_port (the rendezvous port the other nodes connect to), got 0"
    assert EngineConfig(tensor_parallel_size=4, nnodes=2, master_port=29500).nnodes == 2
