"""The one way tests and benches start an ensemble takes ``pdserve up``'s own flags (pdserve/loadtest/cluster.py)."""

from __future__ import annotations

import sys

from pdserve.loadtest.cluster import Cluster, up_argv
from pdserve.services import up


def test_the_in_process_cluster_reads_up_flags_with_the_commands_own_parser():
    opts = up.parse(["--prefill", "0", "--decode", "2", "--dtype", "float32", "--enable-prefix-caching",
                     "--port", "8123"])
    assert (opts.num_prefill, opts.num_decode, opts.port, opts.colocated) == (0, 2, 8123, False)
    assert opts.engine == {"PDSERVE_DTYPE": "float32", "PDSERVE_ENABLE_PREFIX_CACHING": "true"}
    assert up.parse([]) == up.UpOptions()  # the command's defaults are the options' defaults


def test_one_command_line_starts_pdserve_up(tmp_path):
    assert up_argv("--decode", "1") == [sys.executable, "-m", "pdserve.services.cli", "up", "--decode", "1"]
    assert up_argv(python="/other/python")[:4] == ["/other/python", "-m", "pdserve.services.cli", "up"]
    cluster = Cluster("--decode", "1", log_dir=tmp_path, process=True)
    assert cluster.args == ["--decode", "1"] and cluster.port > 0 and cluster.proc is None
