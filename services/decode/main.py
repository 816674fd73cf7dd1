"""``pdserve decode``: one decode worker (KV-transfer server + continuous-batching engine)."""

from __future__ import annotations

import click

from pdserve.shared.worker.cli_options import run_worker, worker_options


@click.command("decode")
@worker_options
@click.option("--kv-port", type=int, default=None, help="KV-transfer TCP port [PDSERVE_KV_PORT, default 9000].")
@click.option("--colocated/--no-colocated", default=None, help="No prefill tier: this pod prefills every request.")
@click.option("--speculative-config", default=None,
              help='Speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' [PDSERVE_SPECULATIVE_CONFIG].')
@click.option("--lease-ttl-s", type=float, default=None, help="Seconds a KV reservation waits for its transfer.")
@click.option("--handover-memory-s", type=float, default=None,
              help="Seconds a taken-over request id is remembered, so a redelivered queue entry is not decoded "
                   "twice [PDSERVE_HANDOVER_MEMORY_S, default 900].")
def command(**flags) -> None:
    """Run a decode worker. Flags override PDSERVE_* environment variables."""
    from pdserve.services.decode.worker import DecodeSettings, DecodeWorker

    run_worker(DecodeSettings, DecodeWorker, flags)


if __name__ == "__main__":
    command()
