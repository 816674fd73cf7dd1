"""``pdserve registry``: one registry replica (stateless; state lives in Redis)."""

from __future__ import annotations

import click

from pdserve.services.registry.settings import RegistrySettings
from pdserve.shared.logs import setup_logging
from pdserve.shared.settings import given, settings_options


@click.command("registry")
@settings_options(RegistrySettings)
def command(**flags: object) -> None:
    """Run the pod registry: heartbeats in, alive prefill/decode pods out."""
    import uvicorn

    from pdserve.services.registry.app import create_app

    settings = RegistrySettings(**given(flags))
    setup_logging(settings.log_level)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), access_log=False)
