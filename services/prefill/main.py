"""``pdserve prefill``: one prefill worker (queue consumer + engine + KV-transfer client)."""

from __future__ import annotations

import click

from pdserve.shared.worker.cli_options import run_worker, worker_options


@click.command("prefill")
@worker_options
@click.option("--max-inflight", type=int, default=None, help="Queue entries held at once [default 64].")
@click.option("--claim-idle-s", type=float, default=None, help="Take over entries idle this long [default 60].")
@click.option("--kv-wait-timeout-s", type=float, default=None,
              help="Seconds a finished prefill waits for a full decode pod's KV blocks before 503 [default 480].")
@click.option("--kv-transfer-timeout-s", type=float, default=None,
              help="Seconds a decode pod may take to answer the KV handshake or a frame [default 20].")
@click.option("--kv-unreachable-cooldown-s", type=float, default=None,
              help="Seconds routers avoid a decode pod whose KV transfer timed out or broke [default 30].")
@click.option("--max-waiting-kv-bytes", type=int, default=None,
              help="Prefilled KV held for decode pods, in bytes, before no new prompt is taken [default 4 GiB].")
def command(**flags) -> None:
    """Run a prefill worker. Flags override PDSERVE_* environment variables."""
    from pdserve.services.prefill.worker import PrefillSettings, PrefillWorker

    run_worker(PrefillSettings, PrefillWorker, flags)


if __name__ == "__main__":
    command()
