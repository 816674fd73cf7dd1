"""README.md's quick start, as a newcomer runs it: ``pdserve up`` from the repository's root, then its ``curl``.

The commands are read from README.md itself, so the test follows README.md when it changes. One deviation: the
router gets a free port (``--port``) instead of 8000, and the curl line is pointed at it, so that CI never fails
on a port another process holds. The oracle is the answer README.md prints beside the curl line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.redis_server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README_MD = (ROOT / "README.md").read_text()


def _quick_start_blocks() -> list[str]:
    section = README_MD[README_MD.index("## Quick start"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def _readme_curl() -> tuple[str, str]:
    """The curl command (continuation lines joined) and the content README.md says it answers."""
    block = next(b for b in _quick_start_blocks() if b.lstrip().startswith("curl"))
    command = block[:block.index("\n#")].strip()
    expected = re.search(r'"content":"([^"]+)"', block).group(1)
    return command, expected


def _pdserve() -> str:
    beside = Path(sys.executable).with_name("pdserve")
    return str(beside) if beside.exists() else shutil.which("pdserve")


def test_readme_names_the_two_commands():
    first = _quick_start_blocks()[0].strip().splitlines()
    assert first[0].startswith("pip install torch==2.13.0 -e \".[test]\"")
    assert first[1] == "pdserve up"


def test_the_quick_start_from_the_repository_root(tmp_path):
    command, expected = _readme_curl()
    port = free_port()
    log = open(tmp_path / "up.out", "w+")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    up = subprocess.Popen([_pdserve(), "up", "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                          env={**env, "PYTHONUNBUFFERED": "1"},
                          start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "Press Ctrl-C to stop." not in (tmp_path / "up.out").read_text():
            assert up.poll() is None, f"pdserve up exited {up.returncode}:\n{(tmp_path / 'up.out').read_text()}"
            assert time.monotonic() < deadline, "pdserve up did not become ready in 600 s"
            time.sleep(0.5)
        curl = command.replace("localhost:8000", f"localhost:{port}")
        out = subprocess.run(["bash", "-c", curl], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["choices"][0]["message"]["content"] == expected
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # Ctrl-C, as README.md says
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait(10)
        log.close()
    assert up.returncode == 0, (tmp_path / "up.out").read_text()[-3000:]
