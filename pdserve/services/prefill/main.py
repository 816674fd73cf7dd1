"""``pdserve prefill``: one prefill worker (queue consumer + engine + KV-transfer client)."""

from __future__ import annotations

import click

from pdserve.services.prefill.settings import PrefillSettings
from pdserve.shared.settings import settings_options
from pdserve.shared.worker.cli_options import run_worker


@click.command("prefill")
@settings_options(PrefillSettings)
def command(**flags) -> None:
    """Run a prefill worker. Flags override PDSERVE_* environment variables."""
    from pdserve.services.prefill.worker import PrefillWorker

    run_worker(PrefillSettings, PrefillWorker, flags)


if __name__ == "__main__":
    command()
