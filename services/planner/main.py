"""``pdserve planner``: size the prefill and decode Deployments against TTFT/TPOT objectives."""

from __future__ import annotations

from typing import Any

import click

from pdserve.shared.logs import setup_logging

from .settings import PlannerSettings


@click.command("planner")
@click.option("--host", default=None, help="Bind address of /health and /metrics [PDSERVE_HOST, default 0.0.0.0].")
@click.option("--port", type=int, default=None, help="HTTP port [PDSERVE_PORT, default 8004].")
@click.option("--redis-url", default=None, help="Redis with the prefill queue [PDSERVE_REDIS_URL or REDIS_URL].")
@click.option("--namespace", default=None, help="Namespace of the Deployments [PDSERVE_NAMESPACE or POD_NAMESPACE].")
@click.option("--prefill-deployment", default=None, help="Prefill Deployment name [PDSERVE_PREFILL_DEPLOYMENT].")
@click.option("--decode-deployment", default=None, help="Decode Deployment name [PDSERVE_DECODE_DEPLOYMENT].")
@click.option("--router-deployment", default=None, help="Router Deployment whose pods export TTFT/TPOT ('' = none).")
@click.option("--interval-seconds", type=float, default=None, help="Seconds between rounds [default 15].")
@click.option("--ttft-slo-seconds", type=float, default=None, help="Time-to-first-token objective [default 2.0].")
@click.option("--tpot-slo-seconds", type=float, default=None, help="Time-per-output-token objective [default 0.1].")
@click.option("--target-kv-cache-usage", type=float, default=None, help="Decode KV-cache usage to size for (0..1).")
@click.option("--prefill-min-replicas", type=int, default=None)
@click.option("--prefill-max-replicas", type=int, default=None)
@click.option("--decode-min-replicas", type=int, default=None)
@click.option("--decode-max-replicas", type=int, default=None)
@click.option("--dry-run/--no-dry-run", default=None, help="Decide and export metrics, never patch.")
@click.option("--log-level", default=None, help="debug|info|warning|error [PDSERVE_LOG_LEVEL].")
def command(**flags: Any) -> None:
    """Run the SLO planner. Flags override PDSERVE_* environment variables (every setting has one)."""
    import redis
    import uvicorn

    from .app import PlannerLoop, create_app
    from .kube import KubeScaler
    from .planner import Planner

    settings = PlannerSettings(**{k: v for k, v in flags.items() if v is not None})
    setup_logging(settings.log_level)
    planner = Planner(settings, KubeScaler(settings.namespace), redis.Redis.from_url(settings.redis_url))
    app = create_app(PlannerLoop(planner, settings.interval_seconds))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())


# The CLI group registers this object (services/cli.py).
planner = command

if __name__ == "__main__":
    command()
