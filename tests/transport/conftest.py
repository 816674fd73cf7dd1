from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support

from pdserve.shared.transport import KVLayout  # noqa: E402


@pytest.fixture
def layout() -> KVLayout:
    # SmolLM2-135M's KV shape with fewer layers, so tests move little data.
    return KVLayout(block_size=16, dtype="float32", num_layers=2, num_kv_heads=3, head_dim=8,
                    model="smollm2-135m-instruct")
