"""``pdserve prefill``: one prefill worker (queue consumer + engine + KV-transfer client)."""

from __future__ import annotations

import click

from pdserve.shared.worker.cli_options import run_worker, worker_options


@click.command("prefill")
@worker_options
@click.option("--max-inflight", type=int, default=None, help="Queue entries held at once [default 64].")
@click.option("--claim-idle-s", type=float, default=None, help="Take over entries idle this long [default 60].")
def command(**flags) -> None:
    """Run a prefill worker. Flags override PDSERVE_* environment variables."""
    from pdserve.services.prefill.worker import PrefillSettings, PrefillWorker

    run_worker(PrefillSettings, PrefillWorker, flags)


if __name__ == "__main__":
    command()
