"""``pdserve bench token-cost``: what the control plane (Redis and the router) spends per generated token.

Runs the default ``pdserve up`` (one prefill and one decode worker) with ``bench serve``-style load --
``--num-prompts`` random-id prompts of ``--input-len`` tokens, ``--output-len`` tokens each, ``ignore_eos``,
``--max-concurrency`` streams at once -- and reads, before and after the load:

- Redis's ``INFO commandstats`` (calls per command) and ``INFO cpu`` (``used_cpu_user`` + ``used_cpu_sys``);
- each process's CPU time from /proc (user + system; the router, registry and workers by their command line).

It prints Redis commands per token (and the top commands), Redis µs per token and router µs per token. ``--tree
NAME=PATH`` (repeatable) runs the ensemble with ``PYTHONPATH=PATH``, so two checkouts (main and a branch) run in turns
(A B A B for ``--rounds 2``) in one invocation:

    pdserve bench token-cost --tree main=/work/main --tree branch=. --rounds 2
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import time
from urllib.parse import quote

import click
import httpx
import psutil
import redis as redis_sync

from pdserve.loadtest.ensemble_cpu import cpu_by_role, tree_cpu
from pdserve.loadtest.errors import LoadTestError


async def send(base_url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int) -> int:
    """Stream every prompt as a completion, at most ``concurrency`` at once; the generated tokens (usage)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> int:
        body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with gate, client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise LoadTestError(f"a request failed with HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        return sum(await asyncio.gather(*(one(client, p) for p in prompts)))


def redis_counters(client: redis_sync.Redis) -> tuple[dict[str, int], float]:
    """(calls per command, Redis CPU seconds user + system)."""
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    return ({k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()},
            float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))


def redis_port(root: int) -> int:
    for p in psutil.Process(root).children(recursive=True):
        cmd = p.cmdline()
        if cmd and "redis" in os.path.basename(cmd[0]):
            if "--port" in cmd:
                return int(cmd[cmd.index("--port") + 1])
            found = re.search(r":(\d+)", " ".join(cmd))  # redis-server retitles itself "redis-server 127.0.0.1:PORT"
            if found:
                return int(found.group(1))
    raise LoadTestError("no Redis child under `pdserve up`")


def run_turn(tree: str | None, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
             up_args: tuple[str, ...], timeout_s: float) -> dict:
    from pdserve.loadtest.cluster import Cluster

    password = secrets.token_hex(16)
    with Cluster("--model", model, *up_args, env={"PDSERVE_REDIS_PASSWORD": password}, timeout_s=timeout_s,
                 process=True, pythonpath=tree, serving_model=model) as cluster:
        url, proc = cluster.router_url, cluster.proc
        client = redis_sync.Redis.from_url(f"redis://:{quote(password)}@127.0.0.1:{redis_port(proc.pid)}/0")
        asyncio.run(send(url, model, [p[::-1] for p in prompts[:4]], 4, 4))  # warm-up
        before_cpu, (before_calls, before_redis) = tree_cpu(proc.pid), redis_counters(client)
        start = time.perf_counter()
        tokens = asyncio.run(send(url, model, prompts, output_len, concurrency))
        seconds = time.perf_counter() - start
        roles = cpu_by_role(before_cpu, tree_cpu(proc.pid))
        after_calls, after_redis = redis_counters(client)
        client.close()
    calls = {k: n for k, v in after_calls.items() if (n := v - before_calls.get(k, 0)) > 0}
    roles["redis"] = after_redis - before_redis
    return {"tokens": tokens, "seconds": seconds, "calls": calls, "cpu_s": roles, "loadavg": os.getloadavg()[0]}


def line(name: str, r: dict) -> str:
    t = r["tokens"]
    top = ", ".join(f"{k} {n / t:.2f}" for k, n in sorted(r["calls"].items(), key=lambda kv: -kv[1])[:6])
    return (f"  {name:<10}{t / r['seconds']:>7.1f} tok/s  commands/token {sum(r['calls'].values()) / t:>6.3f}  "
            f"Redis {1e6 * r['cpu_s']['redis'] / t:>6.1f} µs/token  router {1e6 * r['cpu_s'].get('router', 0) / t:>6.1f}"
            f" µs/token  registry {1e6 * r['cpu_s'].get('registry', 0) / t:>5.1f}  decode "
            f"{1e3 * r['cpu_s'].get('decode', 0) / t:.2f} ms/token  (load {r['loadavg']:.1f})\n      per token: {top}")


@click.command("token-cost")
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
@click.option("--num-prompts", default=48, show_default=True)
@click.option("--input-len", default=64, show_default=True)
@click.option("--output-len", default=128, show_default=True)
@click.option("--max-concurrency", default=32, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--rounds", default=1, show_default=True, help="Turns per tree (A B A B ...).")
@click.option("--tree", "trees", multiple=True, help="NAME=PATH: run `pdserve up` from this checkout (PYTHONPATH); "
              "repeatable. Default: this installation.")
@click.option("--up-arg", "up_args", multiple=True, help="Extra argument for `pdserve up` (repeatable).")
@click.option("--up-timeout", type=float, default=600.0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def token_cost_command(model, num_prompts, input_len, output_len, max_concurrency, seed, rounds, trees, up_args,
                       up_timeout, json_out) -> None:
    """Redis commands, Redis CPU and router CPU per generated token under `pdserve up`, in turns per checkout."""
    named = [tuple(t.split("=", 1)) if "=" in t else (t, t) for t in trees] or [("this", None)]
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(input_len)] for _ in range(num_prompts)]
    click.echo(f"token-cost: {num_prompts} prompts, {input_len} in / {output_len} out, ignore_eos, concurrency "
               f"{max_concurrency}; {' '.join(n for n, _ in named)} in turns x {rounds}; load average "
               f"{os.getloadavg()[0]:.1f}")
    turns = []
    try:
        for _ in range(rounds):
            for name, path in named:
                r = run_turn(path, model, prompts, output_len, max_concurrency, up_args, up_timeout)
                turns.append({"tree": name, **r})
                click.echo(line(name, r))
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    if json_out:
        with open(json_out, "w") as f:
            json.dump(turns, f, indent=2)
