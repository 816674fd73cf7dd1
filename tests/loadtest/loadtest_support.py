"""Constants and helpers shared by the load-test tests (a unique module name: every tests/ folder has a conftest)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

TOKENIZER = "smollm2-135m-instruct"
STANDIN = Path(__file__).with_name("standin_server.py")  # a two-process stand-in for another project's server


class Mock:
    """A running ``pdserve bench mock-server`` and its request counters."""

    def __init__(self, url: str, pid: int | None = None) -> None:
        self.url = url
        self.pid = pid

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/mock/stats", timeout=10) as r:  # not behind the API key
            return json.load(r)

    def generation_requests(self) -> int:
        reqs = self.stats()["requests"]
        return reqs.get("/v1/completions", 0) + reqs.get("/v1/chat/completions", 0)
