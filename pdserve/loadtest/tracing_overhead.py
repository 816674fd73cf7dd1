"""``pdserve bench tracing-overhead``: one ``bench serve`` workload against fresh ``pdserve up`` ensembles with
OpenTelemetry tracing off and on, in turns (off, on, off, on by default).

Tracing on is ``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at a local OTLP/HTTP sink (a process this command starts: it
decodes every ``POST /v1/traces`` body as a collector would, counts the spans by name and answers 200) and
``OTEL_TRACES_SAMPLER`` (default ``always_on``: sampler 1.0); off is both endpoints set empty, so no process of the
ensemble imports the SDK. Every turn starts its own ``pdserve up`` (plus ``--up-arg``), sends ``--num-warmups``
requests from another seed, waits ``--settle`` seconds (the batch span processor exports every 5 s), then runs the
same requests (``bench serve``'s options; the same in every turn, a fresh ensemble has an empty prefix cache), waits
``--settle`` again and stops the ensemble. Per turn: vLLM's metrics, the CPU seconds of the ensemble's process tree
(router, registry, Redis, workers; psutil user + system, read before the load and after the second wait, so the
exporters' last batches count), output tokens per CPU-second, and the spans the sink received per request.

    pdserve bench tracing-overhead --model smollm2-135m-instruct --dataset random --random-input-len 128 \\
        --random-output-len 64 --ignore-eos --num-prompts 64 --max-concurrency 16 --num-warmups 4
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import click

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.options import GreedyCommand, common_options, to_options

COLUMNS = (("TTFT p50", "median_ttft_ms"), ("TPOT p50", "median_tpot_ms"), ("ITL p50", "median_itl_ms"))


# ---- the OTLP/HTTP sink (its own process: `python -m pdserve.loadtest.tracing_overhead PORT`) ------------------


def serve_sink(port: int) -> None:
    """Answer ``POST /v1/traces`` with 200 after decoding the ``ExportTraceServiceRequest``; ``GET /count``: the
    spans so far as JSON ``{"spans": N, "exports": M, "by_name": {name: N}}``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                           ExportTraceServiceResponse)

    counts: Counter[str] = Counter()
    exports = [0]
    reply = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            counts.update(s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)
            exports[0] += 1
            self._answer(reply, "application/x-protobuf")

        def do_GET(self) -> None:  # noqa: N802
            self._answer(json.dumps({"spans": sum(counts.values()), "exports": exports[0],
                                     "by_name": dict(counts)}).encode(), "application/json")

        def _answer(self, data: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def sink_count(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/count", timeout=10) as resp:
        return json.loads(resp.read())


def start_sink() -> tuple[subprocess.Popen, str]:
    from pdserve.loadtest.procs import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.loadtest.tracing_overhead", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            sink_count(url)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise LoadTestError(f"the OTLP sink did not start (exit {proc.poll()})") from None
            time.sleep(0.2)


# ---- turns ---------------------------------------------------------------------------------------------------


def tracing_env(on: bool, sink_url: str, sampler: str) -> dict[str, str]:
    """The ensemble's OpenTelemetry variables: on, the sink and ``sampler``; off, both endpoints empty."""
    if on:
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": sink_url, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
                "OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}


def parse_turns(value: str) -> list[bool]:
    """``"off,on,off,on"`` -> ``[False, True, False, True]``."""
    names = [t.strip().lower() for t in value.split(",") if t.strip()]
    if not names or any(n not in ("on", "off") for n in names):
        raise LoadTestError(f"--turns: a comma-separated list of on and off, got {value!r}")
    return [n == "on" for n in names]


def one_turn(opts, on: bool, ctx: dict[str, Any]) -> dict[str, Any]:
    """Start ``pdserve up`` with tracing ``on`` or off, warm it up, run the workload; the turn's figures. ``ctx``
    holds the sink, the ``pdserve up`` arguments and the datasets (made in the first turn, reused after)."""
    from pdserve.loadtest.benchmark import prepare, run_prepared, run_sync
    from pdserve.loadtest.ensemble_cpu import cpu_by_role, tree_cpu
    from pdserve.loadtest.preflight import check_server
    from pdserve.loadtest.procs import free_port, running

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--port", str(port), "--model", opts.client.model,
           *ctx["up_args"]]
    env = tracing_env(on, ctx["sink_url"], ctx["sampler"])
    with running(cmd, url + "/health", timeout_s=ctx["up_timeout"], env=env, serving_model=opts.client.model) as proc:
        topts = replace(opts, client=replace(opts.client, base_url=url))
        if "requests" not in ctx:
            info, ctx["requests"] = run_sync(prepare(topts))
            warm_opts = replace(topts, dataset=replace(topts.dataset, seed=topts.dataset.seed + 1))
            ctx["warmups"] = run_sync(prepare(warm_opts))[1][:ctx["num_warmups"]]
        else:
            info = run_sync(check_server(url, opts.client.model, opts.client.api_key))
        if ctx["warmups"]:
            quiet = replace(topts, run=replace(topts.run, show_progress=False))
            run_sync(run_prepared(quiet, info, ctx["warmups"], rate=math.inf))
        time.sleep(ctx["settle"])
        spans0, cpu0, load0 = sink_count(ctx["sink_url"]), tree_cpu(proc.pid), os.getloadavg()[0]
        result, _ = run_sync(run_prepared(topts, info, ctx["requests"]))
        time.sleep(ctx["settle"])
        roles = cpu_by_role(cpu0, tree_cpu(proc.pid))
        spans1 = sink_count(ctx["sink_url"])
    cpu = sum(roles.values())
    by_name = {k: v - spans0["by_name"].get(k, 0) for k, v in spans1["by_name"].items()
               if v - spans0["by_name"].get(k, 0)}
    return {"tracing": "on" if on else "off", "result": result, "cpu_s": cpu, "cpu_by_role": roles,
            "tok_per_cpu_s": result["total_output_tokens"] / cpu if cpu else None,
            "spans": spans1["spans"] - spans0["spans"], "spans_by_name": by_name,
            "loadavg": (load0, os.getloadavg()[0])}


# ---- report --------------------------------------------------------------------------------------------------


def turn_line(i: int, t: dict[str, Any]) -> str:
    r = t["result"]
    n = r["completed"] or 1
    return (f"| {i} | {t['tracing']} | {r['output_throughput']:.1f} | {t['tok_per_cpu_s'] or float('nan'):.2f} | "
            f"{t['cpu_s']:.1f} | " + " | ".join(f"{r.get(k) or float('nan'):.0f}" for _, k in COLUMNS)
            + f" | {t['spans'] / n:.1f} | {r['failed']} | {t['loadavg'][0]:.1f} → {t['loadavg'][1]:.1f} |")


def summary(turns: list[dict[str, Any]]) -> str:
    """A markdown table of the turns, then each arm's pooled figures and on against off."""
    head = ["turn", "tracing", "out tok/s", "tok/CPU-s", "ensemble CPU-s", *(c for c, _ in COLUMNS),
            "spans/request", "failed", "load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [turn_line(i, t) for i, t in enumerate(turns, 1)]
    pooled = {}
    for arm in ("off", "on"):
        mine = [t for t in turns if t["tracing"] == arm]
        if not mine:
            continue
        tokens = sum(t["result"]["total_output_tokens"] for t in mine)
        pooled[arm] = (tokens / sum(t["result"]["duration"] for t in mine), tokens / sum(t["cpu_s"] for t in mine))
        lines.append(f"{arm}: {pooled[arm][0]:.2f} out tok/s, {pooled[arm][1]:.3f} tok/CPU-s over {len(mine)} turns")
    if len(pooled) == 2:
        (a, b), (c, d) = pooled["off"], pooled["on"]
        lines.append(f"on vs off: throughput {100 * (c / a - 1):+.1f}%, tokens per CPU-s {100 * (d / b - 1):+.1f}%")
    return "\n".join(lines)


@click.command("tracing-overhead", cls=GreedyCommand)
@common_options
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="Mean requests per second (gamma arrivals); inf = all at once.")
@click.option("--turns", default="off,on,off,on", show_default=True, help="Tracing off or on per turn, in order.")
@click.option("--sampler", default="always_on", show_default=True, help="OTEL_TRACES_SAMPLER when on.")
@click.option("--settle", type=float, default=7.0, show_default=True,
              help="Seconds waited after the warm-up and after the load (the batch span processor exports every 5 s).")
@click.option("--up-arg", "up_args", multiple=True, help="Extra argument for `pdserve up` (repeatable).")
@click.option("--up-timeout", type=float, default=600.0, show_default=True)
@click.option("--save-result", type=click.Path(dir_okay=False), default=None, help="Write every turn's JSON here.")
def tracing_overhead_command(request_rate, turns, sampler, settle, up_args, up_timeout, save_result, **kw) -> None:
    """`bench serve` against fresh `pdserve up` ensembles, tracing off and on in turns: tok/s, tok/CPU-s, spans."""
    from pdserve.loadtest.results import save_json

    try:
        if click.get_current_context().get_parameter_source("base_url").name != "DEFAULT":
            raise LoadTestError("tracing-overhead starts its own `pdserve up`; --base-url is not used")
        order = parse_turns(turns)
        kw["model"] = kw["model"] or "smollm2-135m-instruct"
        num_warmups, kw["num_warmups"] = kw["num_warmups"], 0  # from another seed, not the measured prompts
        opts = to_options(kw, request_rate)
        sink, sink_url = start_sink()
        ctx = {"sink_url": sink_url, "sampler": sampler, "up_args": up_args, "up_timeout": up_timeout,
               "settle": settle, "num_warmups": num_warmups}
        click.echo(f"tracing-overhead: {turns} (sampler {sampler}), {opts.dataset.num_prompts} {opts.dataset.name} "
                   f"prompts, sink {sink_url}; load average {os.getloadavg()[0]:.1f}", err=True)
        done = []
        try:
            for on in order:
                done.append(one_turn(opts, on, ctx))
                click.echo(turn_line(len(done), done[-1]), err=True)
        finally:
            sink.terminate()
            sink.wait(10)
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(summary(done))
    names = Counter()
    for t in done:
        names.update(t["spans_by_name"])
    if names:
        n = sum(t["result"]["completed"] for t in done if t["tracing"] == "on") or 1
        click.echo("spans per request by name: " + ", ".join(f"{k} {v / n:.2f}" for k, v in names.most_common()))
    if save_result:
        save_json({"turns": done, "sampler": sampler}, Path(save_result))


if __name__ == "__main__":
    serve_sink(int(sys.argv[1]))
