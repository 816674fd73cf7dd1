"""Pytest fixtures over real processes. Wire into tests/conftest.py with
``pytest_plugins = ["support.fixtures"]`` (tests/ on sys.path) or ``from support.fixtures import *``.

- ``redis_server``: a fresh redis-server (no persistence) per test; ``.url``, ``.port``, ``.restart()``.
- ``redis_aof_server``: the same with an append-only file in ``tmp_path`` (for restart tests).
- ``redis_url``: the URL of ``redis_server``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.redis_server import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_aof_server(tmp_path) -> Iterator[RedisServer]:
    with RedisServer(aof_dir=tmp_path / "redis-aof") as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
