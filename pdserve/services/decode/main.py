"""``pdserve decode``: one decode worker (KV-transfer server + continuous-batching engine)."""

from __future__ import annotations

import click

from pdserve.services.decode.settings import DecodeSettings
from pdserve.shared.settings import settings_options
from pdserve.shared.worker.cli_options import run_worker


@click.command("decode")
@settings_options(DecodeSettings)
def command(**flags) -> None:
    """Run a decode worker. Flags override PDSERVE_* environment variables."""
    from pdserve.services.decode.worker import DecodeWorker

    run_worker(DecodeSettings, DecodeWorker, flags)


if __name__ == "__main__":
    command()
