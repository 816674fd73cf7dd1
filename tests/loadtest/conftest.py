"""Real mock servers (separate processes, free ports) for the load-test suite's end-to-end tests."""

from __future__ import annotations

import pytest

from loadtest_support import TOKENIZER, Mock
from pdserve.loadtest.procs import free_port, mock_cmd, running


def _start(*args: str):
    port = free_port()
    with running(mock_cmd(port, *args), f"http://127.0.0.1:{port}/health", timeout_s=120) as proc:
        yield Mock(f"http://127.0.0.1:{port}", proc.pid)


@pytest.fixture(scope="module")
def mock():
    """TTFT 50 ms, 100 tokens/s, one token per chunk, exact /tokenize with the default model's tokenizer."""
    yield from _start("--ttft-ms", "50", "--token-rate", "100", "--tokenizer", TOKENIZER)


@pytest.fixture(scope="module")
def flaky_mock():
    """Every third request fails with HTTP 500; chunks carry three tokens; no /tokenize; API key "sesame"."""
    yield from _start("--ttft-ms", "5", "--token-rate", "1000", "--tokens-per-chunk", "3", "--fail-every", "3",
                      "--api-key", "sesame")
