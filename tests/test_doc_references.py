"""Every documentation reference in the repository resolves.

Code, YAML, templates and Markdown cite documentation in three forms, and each must land on something real:

- ``path/to/FILE.md "Heading"`` (also ``FILE.md, "Heading"``): FILE.md exists at that path from the repository root
  and has a heading with that title (Markdown ``#`` lines, compared without backticks and case);
- ``path/to/FILE.md §N``: FILE.md has a heading numbered ``N.``;
- Markdown links ``[text](relative/path.md#anchor)``: the file exists and, with an anchor, has a heading whose
  GitHub anchor is that one.

A bare ``README`` or ``DESIGN`` in .py/.yaml/.tpl files (no path, no ``.md``) is refused: the repository has a
README in several folders, and the design map lives in ``docs/design.md``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", "node_modules", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", ".venv"}
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".tpl"}
SUFFIXES = CODE_SUFFIXES | {".md"}

# FILE.md followed by a section: "Title" (straight or curly quotes) or §N; `,`/`:`/`(` may sit between.
CITATION = re.compile(r'(?P<file>[\w./-]*\b[\w-]+\.md)[,:]?\s*\(?\s*(?:["“](?P<title>[^"”\n]+)["”]|§\s*(?P<num>\d+))')
MD_LINK = re.compile(r"\[[^\]\n]*\]\((?P<target>[^)\s]+)\)")
BARE = re.compile(r"\b(README|DESIGN)\b(?!\.md)")


def _files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        if (path.suffix in SUFFIXES and path.is_file() and path != Path(__file__).resolve()
                and not SKIP_DIRS.intersection(path.relative_to(ROOT).parts)):
            out.append(path)
    return sorted(out)


def _headings(md: Path) -> list[str]:
    titles, fence = [], False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            titles.append(line.lstrip("#").strip())
    return titles


def _norm(title: str) -> str:
    return re.sub(r"\s+", " ", title.replace("`", "")).strip().lower()


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _resolve(cited: str, source: Path) -> Path | None:
    """A cited file: from the repository root (the convention in code), else relative to the citing file."""
    for base in (ROOT, source.parent):
        candidate = (base / cited).resolve()
        if candidate.is_file():
            return candidate
    return None


def _citation_problems(path: Path, text: str) -> list[str]:
    problems = []
    for m in CITATION.finditer(text):
        target = _resolve(m["file"], path)
        if target is None:
            problems.append(f"{m['file']} does not exist")
            continue
        titles = _headings(target)
        if m["title"] is not None and _norm(m["title"]) not in {_norm(t) for t in titles}:
            problems.append(f'{m["file"]} has no heading "{m["title"]}"')
        if m["num"] is not None and not any(re.match(rf"{m['num']}\.\s", t) for t in titles):
            problems.append(f"{m['file']} has no section {m['num']}.")
    return problems


def _link_problems(path: Path, text: str) -> list[str]:
    problems = []
    for m in MD_LINK.finditer(text):
        target = m["target"]
        if re.match(r"[a-z]+:", target) or target.startswith("#") and path.suffix != ".md":
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        if not dest.exists():
            problems.append(f"link {target}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in {_anchor(t) for t in _headings(dest)}:
            problems.append(f"link {target}: no heading with anchor #{anchor}")
    return problems


def _bare_problems(path: Path, text: str) -> list[str]:
    if path.suffix not in CODE_SUFFIXES:
        return []
    return [f"bare {m[1]!r} (name the file: README.md at the root, helm/pdserve/README.md, docs/design.md ...)"
            for m in BARE.finditer(text)]


def test_every_cited_document_and_section_exists():
    problems = []
    for path in _files():
        text = path.read_text(encoding="utf-8", errors="replace")
        found = _citation_problems(path, text) + _bare_problems(path, text)
        if path.suffix == ".md":
            found += _link_problems(path, text)
        problems += [f"{path.relative_to(ROOT)}: {p}" for p in found]
    assert not problems, "unresolved documentation references:\n" + "\n".join(problems)


@pytest.mark.parametrize("text, ok", [
    ('see docs/design.md §2', True), ('see docs/design.md §9', False),
    ('(helm/pdserve/README.md "Network policies")', True), ('(helm/pdserve/README.md "Network policy")', False),
    ('docs/nothing.md "X"', False), ('tests/chaos/README.md, "10x overload"', True),
])
def test_the_checker_tells_a_real_section_from_a_missing_one(text, ok):
    assert (not _citation_problems(ROOT / "setup.py", text)) is ok


def test_the_checker_resolves_links_and_anchors():
    readme = ROOT / "README.md"
    assert not _link_problems(readme, "[x](docs/ensemble.md#stopping) [y](#architecture)")
    assert _link_problems(readme, "[x](docs/ensemble.md#no-such-heading)")
    assert _link_problems(readme, "[x](docs/missing.md)")
    assert _bare_problems(ROOT / "setup.py", "see README") and not _bare_problems(ROOT / "setup.py", "README.md")
