"""A worker's SIGINT/SIGTERM handler while its engine is being built (``pdserve/shared/worker/base.py``); the
whole path through ``pdserve up`` is tests/cli/test_up.py's."""

from __future__ import annotations

import multiprocessing
import os
import signal

import psutil
import pytest

from pdserve.shared.worker.base import exit_while_loading


def _worker(pid_file: str, ready) -> None:  # the worker process: forks one "rank", then gets the signal mid-load
    ctx = multiprocessing.get_context("fork")
    rank = ctx.Process(target=ready.wait, daemon=True)  # would wait forever
    rank.start()
    with open(pid_file, "w") as f:
        f.write(str(rank.pid))
    exit_while_loading(os.getpid())(signal.SIGTERM, None)


@pytest.mark.slow  # forks processes
def test_the_loading_handler_exits_its_own_process_and_kills_the_ranks_it_forked(tmp_path):
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_worker, args=(str(tmp_path / "rank.pid"), ctx.Event()))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 128 + signal.SIGTERM
    rank = int((tmp_path / "rank.pid").read_text())
    try:
        psutil.Process(rank).wait(10)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        psutil.Process(rank).kill()
        raise AssertionError("the rank outlived its worker") from None


def test_a_rank_forked_during_the_load_ignores_the_handler_it_inherits():
    # not the handler's owner: its leader kills it, or stops it after a graceful stop (never an exit mid-collective)
    assert exit_while_loading(os.getpid() + 1)(signal.SIGTERM, None) is None
