"""``pdserve planner``: size the prefill and decode Deployments against TTFT/TPOT objectives."""

from __future__ import annotations

from typing import Any

import click

from pdserve.shared.logs import setup_logging
from pdserve.shared import redis_client
from pdserve.shared.settings import given, settings_options

from .settings import PlannerSettings


@click.command("planner")
@settings_options(PlannerSettings)
def command(**flags: Any) -> None:
    """Run the SLO planner. Flags override PDSERVE_* environment variables (every setting has one)."""
    import uvicorn

    from .app import PlannerLoop, create_app
    from .kube import KubeScaler
    from .planner import Planner

    settings = PlannerSettings(**given(flags))
    setup_logging(settings.log_level)
    scaler = KubeScaler(settings.namespace, kinds=settings.workload_kinds())
    planner = Planner(settings, scaler, redis_client.connect(settings.redis_url, sync=True))
    app = create_app(PlannerLoop(planner, settings.interval_seconds))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())


# The CLI group registers this object (pdserve/services/cli.py).
planner = command

if __name__ == "__main__":
    command()
