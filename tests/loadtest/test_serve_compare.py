"""``pdserve bench serve-compare``'s launcher: a foreign server's clean environment and the CPU of its whole process
tree, with a stand-in server of two processes (CI has no `vllm serve`). The command end to end against the mock
server is in test_serve_mock.py (its module fixture)."""

from __future__ import annotations

import json
import sys
import urllib.request
from contextlib import ExitStack

import pytest

import pdserve
from pdserve.loadtest.procs import cpu_delta, tree_cpu_seconds
from pdserve.loadtest.serve_compare import parse_servers, start_all

from loadtest_support import STANDIN

pytestmark = pytest.mark.slow  # starts processes


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


def test_a_launched_foreign_server_gets_a_clean_environment_and_its_whole_tree_is_counted(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/nonexistent/pdserve-tree")
    monkeypatch.setenv("PDSERVE_TEST_USER_SETTING", "kept")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as if `import pdserve` had set it
    monkeypatch.setattr(pdserve, "ENV_SET_ON_IMPORT", ("OMP_WAIT_POLICY",))
    servers = parse_servers((f"standin={sys.executable} {STANDIN} {{port}}",))
    with ExitStack() as stack:
        start_all(stack, servers, "m", (), timeout_s=60)
        url, root = servers[0].url, servers[0].root_pid
        env = _get(url + "/env")
        assert "PYTHONPATH" not in env and "OMP_WAIT_POLICY" not in env
        assert env["PDSERVE_TEST_USER_SETTING"] == "kept"

        before = tree_cpu_seconds(root)
        burn = _get(url + "/burn?s=0.5")
        after = tree_cpu_seconds(root)
    assert burn["engine_pid"] in after and root in after  # the engine child is part of the tree
    # /proc counts in clock ticks (10 ms), user and system apart: a tick or two below the child's own clock at most
    assert cpu_delta(before, after) >= burn["engine_cpu_s"] - 0.03
    assert cpu_delta(before, after) < burn["engine_cpu_s"] + 1.0
    assert after[root] - before[root] < burn["engine_cpu_s"] / 2  # the front alone would miss it
