"""``pdserve registry``: one registry replica (stateless; state lives in Redis)."""

from __future__ import annotations


import click

from pdserve.shared.logs import setup_logging


@click.command("registry")
@click.option("--host", default=None, help="Bind address [PDSERVE_HOST, default 0.0.0.0].")
@click.option("--port", type=int, default=None, help="HTTP port [PDSERVE_PORT, default 8001].")
@click.option("--redis-url", default=None, help="Redis URL [PDSERVE_REDIS_URL or REDIS_URL].")
@click.option("--pod-ttl-s", type=float, default=None,
              help="Seconds without a heartbeat after which a pod is dropped [PDSERVE_POD_TTL_S, default 5].")
@click.option("--auth-token", default=None,
              help="Bearer token callers must send (all paths but /health, /metrics) [PDSERVE_REGISTRY_TOKEN; "
                   "prefer the variable: a flag shows in the process list]. Unset: no authentication.")
@click.option("--log-level", default=None, help="[PDSERVE_LOG_LEVEL, default info].")
def command(**flags: object) -> None:
    """Run the pod registry: heartbeats in, alive prefill/decode pods out."""
    import uvicorn

    from pdserve.services.registry.app import create_app
    from pdserve.services.registry.settings import RegistrySettings

    settings = RegistrySettings(**{k: v for k, v in flags.items() if v is not None})
    setup_logging(settings.log_level)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), access_log=False)
