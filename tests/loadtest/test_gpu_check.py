"""The GPU check (pdserve/loadtest/gpu_check.sh) and ``bench throughput --device cuda`` on a machine without a usable GPU: both
stop at once with a message that says so, instead of hanging or measuring the CPU under a GPU's name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

SCRIPT = Path(__file__).resolve().parents[2] / "pdserve" / "loadtest" / "gpu_check.sh"


@pytest.mark.slow  # starts bash and a Python that imports torch: about 3 s
def test_gpu_check_without_a_gpu_exits_2_at_once_and_says_why(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU from torch, so this holds on a GPU machine too
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out")}
    env.pop("GPU_CHECK_DEVICE", None)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: no CUDA GPU visible to torch" in proc.stderr
    assert "gpu_check: FAILED: no usable CUDA GPU (see above); nothing was measured" in proc.stderr
    assert not (tmp_path / "out").exists()  # no step ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_bench_throughput_on_cuda_without_a_gpu_is_a_clear_error():
    from pdserve.loadtest.throughput_bench import throughput_command

    result = CliRunner().invoke(throughput_command, ["--device", "cuda", "--num-requests", "2"])
    assert result.exit_code == 1
    assert "Error: --device cuda: torch sees no CUDA device here" in result.output
