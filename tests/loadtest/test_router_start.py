"""``pdserve bench router-start``'s pure parts: ``--tree`` parsing, and the /proc/PID/maps reading that says whether a
process loaded torch (the figures themselves are in pdserve/loadtest/README.md "Router start"; a run starts routers, which the
fast tier does not)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import click
import pytest

from pdserve.loadtest.router_start import _parse_trees, torch_mapped
from pdserve.services.up import redis_executable

ROOT = Path(__file__).resolve().parents[2]


def test_trees_are_name_equals_a_pdserve_checkout(tmp_path):
    assert _parse_trees((f"after={ROOT}", f"again={ROOT}")) == {"after": ROOT, "again": ROOT}
    for bad in (str(ROOT), f"={ROOT}", f"x={tmp_path}"):
        with pytest.raises(click.BadParameter, match="expected NAME=DIR"):
            _parse_trees((bad,))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux /proc")
def test_torch_mapped_tells_a_process_with_torch_from_one_without():
    import torch  # noqa: F401  (this process: mapped)

    assert torch_mapped(os.getpid()) is True
    # a process without torch: a redis-server (the one process the fast tier may start), listening nowhere
    redis = subprocess.Popen([redis_executable(), "--port", "0", "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.2)
        assert torch_mapped(redis.pid) is False
    finally:
        redis.terminate()
        redis.wait(10)
    assert torch_mapped(2**22 + 7) is None  # no such process (pid_max is at most 2**22)
