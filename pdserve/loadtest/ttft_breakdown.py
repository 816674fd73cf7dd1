"""Where a disaggregated request's TTFT goes: queue wait, prefill, KV transfer, first decode step.

Starts ``pdserve up --prefill 1 --decode 1`` on free ports, sends ``--requests`` requests one after
another, each a distinct ``--prompt-tokens``-token prompt (random token ids: no prefix-cache hits) with
``max_tokens=2`` (one token from the prefill pod, one from the decode pod), then reads the pods'
histograms (``/metrics``) and prints the mean of each stage next to the client's TTFT:

* queue wait: router enqueue -> the prefill pod takes it (``pdserve:request_queue_time_seconds``)
* prefill: taken -> first token sampled (``pdserve:request_prefill_time_seconds``)
* KV transfer: reserve -> commit acknowledged (``pdserve:kv_transfer_seconds``, prefill pod)
* first decode step: commit -> the decode pod's first token (``pdserve:first_decode_step_seconds``)

    pdserve bench ttft-breakdown --prompt-tokens 1000 --requests 8
"""

from __future__ import annotations

import random
import statistics
import time

import click
import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.loadtest.cluster import Cluster
from pdserve.loadtest.sse import read_chunks

STAGES = [
    ("queue wait", "prefill", "pdserve:request_queue_time_seconds"),
    ("prefill", "prefill", "pdserve:request_prefill_time_seconds"),
    ("KV transfer", "prefill", "pdserve:kv_transfer_seconds"),
    ("first decode step", "decode", "pdserve:first_decode_step_seconds"),
]


def _histogram_mean(metrics_text: str, name: str) -> tuple[float, int]:
    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return (total / count if count else float("nan")), int(count)


@click.command("ttft-breakdown")
@click.option("--prompt-tokens", default=1000, show_default=True)
@click.option("--requests", "num_requests", default=8, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
def ttft_breakdown_command(prompt_tokens: int, num_requests: int, dtype: str, model: str) -> None:
    """TTFT of a disaggregated request split into queue wait, prefill, KV transfer, first decode step."""
    rng = random.Random(0)
    with Cluster("--prefill", "1", "--decode", "1", "--dtype", dtype, "--model", model, timeout_s=600,
                 process=True, serving_model=model) as cluster:
        router_url = cluster.router_url
        client_ttft = []
        with httpx.Client(timeout=300) as http:
            for _ in range(num_requests + 1):  # the first one warms up and is left out
                prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
                body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                        "ignore_eos": True}
                start = time.perf_counter()
                first = None
                with http.stream("POST", f"{router_url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    for _ in read_chunks(resp.iter_lines()):
                        if first is None:
                            first = time.perf_counter() - start
                client_ttft.append(first)
        pods = {role: cluster.pods(role)[0] for role in ("prefill", "decode")}
        texts = {role: httpx.get(f"http://{p['host']}:{p['http_port']}/metrics", timeout=10).text
                 for role, p in pods.items()}
    click.echo(f"\nTTFT breakdown, {prompt_tokens}-token prompts, {num_requests} requests one at a time, {dtype}, "
               "means (the warm-up request is in the pods' histograms, not in the client's figure)")
    click.echo(f"{'stage':<20}{'ms':>10}{'samples':>9}")
    for label, role, metric in STAGES:
        mean, count = _histogram_mean(texts[role], metric)
        click.echo(f"{label:<20}{mean * 1000:>10.1f}{count:>9d}")
    click.echo(f"{'client TTFT':<20}{statistics.mean(client_ttft[1:]) * 1000:>10.1f}{num_requests:>9d}")


if __name__ == "__main__":
    ttft_breakdown_command()
