"""The router's GETs to a worker's own HTTP port (``/health``, ``/v1/requests/{id}``), asked when a request's output
has gone silent and Redis alone cannot tell a slow pod from a dead one.

They share one ``httpx.AsyncClient`` per router (``RouterState.http``): making a client loads the CA bundle,
about 58 ms of CPU on a 2-core machine, which a client per check would spend on the router's event loop for every
silent request of a fault storm (many at once when a decode pod dies).
"""

from __future__ import annotations

import httpx

# a worker's /health waits up to 2 s on Redis before it answers
PROBE_TIMEOUT_S = 5.0


def probe_client() -> httpx.AsyncClient:
    """The router's one client for pod probes; the app closes it at shutdown."""
    return httpx.AsyncClient(timeout=PROBE_TIMEOUT_S)


async def probe(http: httpx.AsyncClient | None, url: str) -> httpx.Response:
    """``GET url`` through ``http``, or through a client of its own when none is given (a test's Migrator).
    Raises ``httpx.HTTPError`` when the pod does not answer within ``PROBE_TIMEOUT_S``."""
    if http is not None:
        return await http.get(url, timeout=PROBE_TIMEOUT_S)
    async with probe_client() as client:
        return await client.get(url)
