"""``pdserve router``: run the OpenAI-compatible gateway under uvicorn."""

from __future__ import annotations

from typing import Any

import click

from pdserve.shared import tracing
from pdserve.shared.logs import setup_logging
from pdserve.shared.settings import given, settings_options

from .settings import RouterSettings, load_settings


@click.command("router")
@settings_options(RouterSettings)
def command(**flags: Any) -> None:
    """Run the router (OpenAI-compatible REST gateway). Flags override PDSERVE_* environment variables."""

    from .app import create_app
    from .drain import DrainingServer
    from .server import server_config

    settings = load_settings(**given(flags))
    setup_logging(settings.log_level)
    tracing.setup("pdserve-router")  # on only when an OTLP endpoint is set (docs/observability.md "Tracing")
    app = create_app(settings)
    DrainingServer(server_config(app, settings), app.state.drain).run()  # SIGTERM drains first (drain.py)


if __name__ == "__main__":
    command()
