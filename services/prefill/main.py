"""``pdserve prefill``: one prefill worker (queue consumer + engine + KV-transfer client)."""

from __future__ import annotations

import asyncio
import logging

import click

from pdserve.shared.worker.cli_options import given, worker_options


@click.command("prefill")
@worker_options
@click.option("--max-inflight", type=int, default=None, help="Queue entries held at once [default 64].")
@click.option("--claim-idle-s", type=float, default=None, help="Take over entries idle this long [default 60].")
def command(**flags) -> None:
    """Run a prefill worker. Flags override PDSERVE_* environment variables."""
    from pdserve.services.prefill.worker import PrefillSettings, PrefillWorker
    from pdserve.shared.worker.base import serve

    settings = PrefillSettings(**given(flags))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise
    asyncio.run(serve(PrefillWorker(settings)))


if __name__ == "__main__":
    command()
