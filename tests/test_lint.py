"""ruff with the rules of pyproject.toml's [tool.ruff] (syntax errors, pyflakes, shared argument defaults) over the
whole repository: a fast test, so CI (.ci/run runs the suite) and a local run both lint."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ruff.__main__ import find_ruff_bin

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    out = subprocess.run([os.fsdecode(find_ruff_bin()), "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
