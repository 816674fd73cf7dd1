"""``pdserve decode``: one decode worker (KV-transfer server + continuous-batching engine)."""

from __future__ import annotations

import asyncio
import logging

import click

from pdserve.shared.worker.cli_options import given, worker_options


@click.command("decode")
@worker_options
@click.option("--kv-port", type=int, default=None, help="KV-transfer TCP port [PDSERVE_KV_PORT, default 9000].")
@click.option("--colocated/--no-colocated", default=None, help="No prefill tier: this pod prefills every request.")
@click.option("--lease-ttl-s", type=float, default=None, help="Seconds a KV reservation waits for its transfer.")
def command(**flags) -> None:
    """Run a decode worker. Flags override PDSERVE_* environment variables."""
    from pdserve.services.decode.worker import DecodeSettings, DecodeWorker
    from pdserve.shared.worker.base import serve

    settings = DecodeSettings(**given(flags))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise
    asyncio.run(serve(DecodeWorker(settings)))


if __name__ == "__main__":
    command()
