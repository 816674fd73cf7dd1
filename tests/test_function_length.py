"""Code rule: no function in pdserve/services/ or pdserve/shared/ is longer than 80 lines.

A long function is usually several jobs in one; the limit keeps each one readable at a glance, as
nano-vllm's. Counted from the ``def`` line to the last line of the body, decorators excluded.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def _long_functions(folder: str, root: Path = ROOT):
    for path in sorted((root / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_LINES:
                    yield f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)"


@pytest.mark.parametrize("folder", ["pdserve/services", "pdserve/shared"])
def test_no_function_is_longer_than_80_lines(folder):
    assert list(_long_functions(folder)) == []


def test_the_rule_sees_a_long_function(tmp_path):
    # the rule itself can fail: a 90-line function in a scratch tree is reported
    body = "\n".join(f"    x{i} = {i}" for i in range(90))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def long():\n{body}\n")
    assert [s.split(" ")[1] for s in _long_functions("pkg", tmp_path)] == ["long"]
