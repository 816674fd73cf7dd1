"""Builds a kernel's C source into a shared library at first use and loads it with ctypes.

``gcc <flags> -fopenmp -shared`` into ``$PDSERVE_CACHE_DIR/kernels`` (default ``~/.cache/pdserve/kernels``),
keyed by the source, the flags and this CPU's flags (``-march=native``), written atomically so concurrent
processes may race harmlessly. OpenMP is the libgomp torch already loaded (same soname), so
``torch.set_num_threads`` governs the kernels' threads too. No compiler, or a failed build: ``None``, and
a warning naming the reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _source_text(source: Path) -> bytes:
    """``source`` and every ``#include "name"`` beside it (one level): a change to either rebuilds."""
    text = source.read_bytes()
    for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.M):
        text += (source.parent / name.decode()).read_bytes()
    return text


def build(source: Path, flags: list[str]) -> Path:
    """Path of the library built from ``source`` with ``flags``; RuntimeError when it cannot be built."""
    text = _source_text(source)
    key = hashlib.sha256(text + " ".join(flags).encode() + cpu_flags().encode()).hexdigest()[:16]
    root = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "kernels"
    target = root / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building {source.name} failed: {e.stderr[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source: Path, flags: list[str]) -> ctypes.CDLL | None:
    """``build`` then ``ctypes.CDLL``; ``None`` (and a warning) when either fails."""
    try:
        return ctypes.CDLL(str(build(source, flags)))
    except (RuntimeError, OSError) as e:
        logger.warning("CPU kernel %s unavailable, using the PyTorch path: %s", source.name, e)
        return None
