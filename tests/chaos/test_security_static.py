"""Security properties that are facts about the code: no unpickling anywhere in the serving path, API keys
and KV-transfer MACs compared in constant time. (The KV-transfer handshake itself — challenge-response,
the secret never on the wire, refusals — and the frame limits and frame-parser fuzzing are exercised in
tests/transport/test_kv_transfer.py and tests/transport/test_frames.py.)"""

from __future__ import annotations

import hmac
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVING = [ROOT / "pdserve" / "services", ROOT / "pdserve" / "shared"]


def sources():
    for base in SERVING:
        yield from base.rglob("*.py")


@pytest.mark.parametrize("pattern", [r"\bimport pickle\b", r"\bpickle\.loads?\(", r"\bcloudpickle\b",
                                     r"\bdill\b", r"allow_pickle\s*=\s*True", r"\bmarshal\.loads\("])
def test_nothing_unpickles(pattern):
    hits = [f"{p.relative_to(ROOT)}" for p in sources() if re.search(pattern, p.read_text(errors="replace"))]
    assert hits == []


def test_torch_load_only_with_weights_only():
    for p in sources():
        for line in p.read_text(errors="replace").splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{p}: {line.strip()}"


def test_api_key_check_uses_constant_time_compare(monkeypatch):
    from pdserve.services.router import middleware

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    assert middleware.key_matches("sk-right", ["sk-other", "sk-right", "sk-third"]) is True
    assert len(calls) == 3  # every key compared, no early exit on the match
    calls.clear()
    assert middleware.key_matches("sk-wrong", ["sk-right"]) is False
    assert calls == [(b"sk-wrong", b"sk-right")]


def test_kv_transfer_handshake_compares_macs_in_constant_time():
    from pdserve.shared.transport import handshake

    source = Path(handshake.__file__).read_text()
    assert source.count("hmac.compare_digest") >= 2  # each side checks the other's MAC
    assert not re.search(r"\.mac\s*[!=]=", source)
