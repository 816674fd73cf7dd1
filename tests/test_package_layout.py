"""The repository root never lends a top-level module name to a process started there.

transformers 5.25 imports Hugging Face's ``kernels`` distribution at start-up. While the repository root was the
package ``pdserve`` itself, its folders ``kernels/``, ``shared/``, ``services/`` and ``loadtest/`` were also the
top-level modules ``kernels``, ``shared``, ... of every process whose ``sys.path`` starts at the root (``python -m``,
``python -c``, ``python -m pytest``, a notebook), and ``pdserve up`` died with ``cannot import name
'CUDAProperties' from 'kernels'``. The package now lives in ``pdserve/``. Each test runs a fresh interpreter from
the root, as a user does, and fails on the old layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # fresh interpreters (CI's pinned run also runs this file: .ci/run)

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("kernels", "shared", "services", "loadtest")


def _run_from_root(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_no_folder_of_the_root_is_a_top_level_module():
    # find_spec of each name must not land inside the repository (namespace packages included)
    out = _run_from_root(f"""
        import importlib.util, json
        found = {{}}
        for name in {SUBPACKAGES!r}:
            spec = importlib.util.find_spec(name)
            found[name] = None if spec is None else list(spec.submodule_search_locations or [spec.origin])
        print(json.dumps(found))
    """)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    inside = {name: paths for name, paths in found.items()
              if paths and any(str(ROOT) in str(p) and "site-packages" not in str(p) for p in paths)}
    assert inside == {}


def test_an_installed_distribution_named_kernels_wins_over_the_repository(tmp_path):
    # a stand-in for Hugging Face's `kernels` on the path after the root: the interpreter must find it, not ours
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("STAND_IN = True\n")
    (site / "kernels-9.9.9.dist-info").mkdir()
    (site / "kernels-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 9.9.9\n")
    out = _run_from_root("import kernels; print(getattr(kernels, 'STAND_IN', False), kernels.__file__)", site)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "True", out.stdout


def test_transformers_then_the_engine_import_from_the_root():
    # the order a notebook or `python -c` uses: transformers first (it imports `kernels` when that is installed)
    out = _run_from_root("""
        from transformers import LlamaConfig
        from pdserve.shared.engine.llm_engine import LLMEngine
        import pdserve
        print(pdserve.__file__)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert Path(out.stdout.strip()) == ROOT / "pdserve" / "__init__.py"
