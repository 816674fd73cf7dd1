"""The registry app in-process (ASGI) behind a real ``RegistryClient`` and a real redis-server, and stand-in pod
records for it: what the dispatcher and the prefill policy tests register and route against."""

from __future__ import annotations

import httpx

from pdserve.services.registry.app import create_app
from pdserve.services.registry.settings import RegistrySettings
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.registry_client import RegistryClient

BLOCK = 16  # the stand-in pods' block size


def pod(pod_id: str, role: str = "decode", **kw) -> PodInfo:
    """A pod record with a free KV pool of 1000 blocks; ``kw`` overrides any field."""
    base = dict(pod_id=pod_id, role=role, host="127.0.0.1", http_port=8003, kv_port=9000 if role == "decode" else 0,
                model="m", block_size=BLOCK, total_blocks=1000, free_blocks=1000)
    return PodInfo(**{**base, **kw})


async def registry_client(redis_url: str):
    """Yields a client of a registry app served in-process on ``redis_url``; closes both after."""
    app = create_app(RegistrySettings(redis_url=redis_url))
    client = RegistryClient("http://registry", transport=httpx.ASGITransport(app=app))
    try:
        yield client
    finally:
        await client.aclose()
        await app.state.store.redis.aclose()
