"""``python -m pdserve.loadtest.offline_throughput`` says what it runs and shows a progress bar per system."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offline_throughput_announces_each_system_and_shows_its_progress():
    # seed 52 draws 3 short requests (outputs of 17, 11 and 12 tokens; seed 0's are 95, 91 and 21): the test is
    # about what the command prints, not about throughput
    proc = subprocess.run([sys.executable, "-m", "pdserve.loadtest.offline_throughput", "--num-requests", "3",
                           "--seed", "52", "--dtypes", "float32", "--hf-batch-size", "2", "--skip", "hf-continuous"],
                          capture_output=True, text=True, timeout=580, env={**os.environ, "TQDM_MININTERVAL": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("offline throughput: 3 requests (prompts 16-256, outputs 8-128 tokens, "), out
    assert "systems pdserve, hf-static x dtypes float32" in out
    for line in ("[float32] pdserve (model load and warm-up first)", "[float32] HF transformers, static batches of 2"):
        assert line in out
    # the bars (stderr): pdserve's over requests, HF static's over batches, each run to its end
    assert "3/3" in proc.stderr and "hf-static float32: 100%" in proc.stderr and "2/2" in proc.stderr, proc.stderr
