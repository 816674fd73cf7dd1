"""KV-aware routing vs round-robin on a multi-turn chat workload (prints figures).

Workload: one system prompt (``--system-tokens``, default 1,000) shared by every user; ``--users`` users
chat concurrently (user k starts ``k x --user-interval-s`` in), each ``--turns`` turns in sequence (turn k+1 carries the whole conversation so far,
the answers included). Each routing mode runs against a fresh ``pdserve up --prefill 1 --decode 2``
(``PDSERVE_ROUTING_MODE=round_robin|kv``), same flags otherwise. Figures per mode:

* prefix hit rate: prompt tokens found in the prefix caches / prompt tokens looked up, over the decode
  pods (each pod's engine counters, ``/v1/stats``) and the prefill pod;
* KV bytes transferred: what the decode pods received over KV transfer (``kv_bytes_received``);
* TTFT p50/p99 as the client sees it (request sent -> first streamed token), and the placement decisions.

Run: ``python -m pdserve.loadtest.kv_routing_bench [--users 32 --turns 3]``.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx

from pdserve.loadtest.cluster import Cluster
from pdserve.loadtest.sse import aread_chunks

MODEL = "smollm2-135m-instruct"
TOPICS = ["sourdough bread", "bicycle repair", "tide pools", "chess openings", "houseplants", "jazz chords",
          "desert hiking", "home networking", "bird migration", "watercolor painting", "beekeeping", "kite design"]


def system_prompt(tokenizer, n_tokens: int) -> str:
    """A natural-looking system prompt of about ``n_tokens`` tokens (cut on a token boundary)."""
    rules = " ".join(f"Rule {i}: when the user asks about topic number {i}, answer in at most {i % 5 + 2} short "
                     f"sentences, cite no sources, and stay friendly and precise." for i in range(400))
    text = "You are a helpful assistant for a hobby club. Follow these house rules. " + rules
    ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def user_message(user: int, turn: int) -> str:
    topic = TOPICS[(user + turn) % len(TOPICS)]
    return (f"I am member {user}. Question {turn + 1}: tell me one useful thing about {topic} "
            f"that a beginner like member {user} would not know, and why it matters.")


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


async def chat_turns(http: httpx.AsyncClient, user: int, turns: int, system: str, max_tokens: int, run: Run,
                     delay_s: float = 0.0) -> None:
    await asyncio.sleep(delay_s)
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(user, turn)})
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        start = time.perf_counter()
        first = None
        answer = []
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    run.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                    return
                async for chunk in aread_chunks(resp.aiter_lines()):
                    for choice in chunk.get("choices", []):
                        delta = choice.get("delta", {}).get("content")
                        if delta:
                            if first is None:
                                first = time.perf_counter() - start
                            answer.append(delta)
        except httpx.HTTPError as exc:
            run.errors.append(f"{type(exc).__name__}: {exc}")
            return
        if first is not None:
            run.ttft.append(first)
        run.e2e.append(time.perf_counter() - start)
        messages.append({"role": "assistant", "content": "".join(answer)})


def counters(router_url: str, registry_url: str, registry_token: str) -> dict:
    """Engine and transfer counters of every pod, and the router's placement decisions."""
    pods = httpx.get(f"{registry_url}/v1/pods", headers={"Authorization": f"Bearer {registry_token}"},
                     timeout=10).json()["pods"]
    out: dict = {"pods": {}}
    for p in pods:
        s = httpx.get(f"http://{p['host']}:{p['http_port']}/v1/stats", timeout=30).json()
        out["pods"][p["pod_id"]] = {"role": p["role"], "queries": s.get("prefix_cache_queries", 0),
                                    "hits": s.get("prefix_cache_hits", 0),
                                    "bytes": s.get("kv_bytes_received", 0), "blocks": s.get("kv_blocks_received", 0)}
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    out["decisions"] = {}
    for m in re.finditer(r'^pdserve:pd_decisions_total\{[^}]*decision="(\w+)"[^}]*\} (\S+)$', text, re.M):
        out["decisions"][m.group(1)] = out["decisions"].get(m.group(1), 0.0) + float(m.group(2))  # summed over reasons
    out["routed"] = {m.group(1): float(m.group(2)) for m in
                     re.finditer(r'^pdserve:routing_decisions_total\{[^}]*pod="([^"]+)"[^}]*\} (\S+)$', text, re.M)}
    return out


def diff(after: dict, before: dict) -> dict:
    pods = {k: {f: v[f] - before["pods"].get(k, {}).get(f, 0) if f != "role" else v[f] for f in v}
            for k, v in after["pods"].items()}
    decisions = {k: v - before["decisions"].get(k, 0) for k, v in after["decisions"].items()}
    routed = {k: v - before["routed"].get(k, 0) for k, v in after["routed"].items()}
    return {"pods": pods, "decisions": decisions, "routed": routed}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def workload(router_url: str, users: int, turns: int, system: str, max_tokens: int, interval_s: float) -> Run:
    run = Run()
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=router_url, timeout=httpx.Timeout(600.0)) as http:
        await asyncio.gather(*(chat_turns(http, u, turns, system, max_tokens, run, u * interval_s)
                               for u in range(users)))
    run.wall_s = time.perf_counter() - start
    return run


def measure(mode: str, args: list[str], users: int, turns: int, system: str, max_tokens: int, interval_s: float,
            timeout_s: float, log_dir: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"pdserve-kvbench-{mode}-") as tmp:
        logs = Path(tmp) if log_dir is None else log_dir / mode
        logs.mkdir(parents=True, exist_ok=True)
        with Cluster(*args, env={"PDSERVE_ROUTING_MODE": mode}, log_dir=logs, timeout_s=timeout_s, process=True,
                     serving_model=MODEL) as up:
            time.sleep(2.0)  # the warm-up request's block events reach the registry
            before = counters(up.router_url, up.registry_url, up.registry_token)
            run = asyncio.run(workload(up.router_url, users, turns, system, max_tokens, interval_s))
            time.sleep(1.5)  # last heartbeats carry the final counters
            delta = diff(counters(up.router_url, up.registry_url, up.registry_token), before)
    pods = delta["pods"]
    decode = [p for p in pods.values() if p["role"] == "decode"]
    q = sum(p["queries"] for p in pods.values())
    h = sum(p["hits"] for p in pods.values())
    dq = sum(p["queries"] for p in decode)
    dh = sum(p["hits"] for p in decode)
    return {
        "mode": mode, "requests": len(run.e2e), "errors": run.errors, "wall_s": run.wall_s,
        "hit_rate": h / q if q else 0.0, "decode_hit_rate": dh / dq if dq else 0.0,
        "kv_bytes": sum(p["bytes"] for p in decode), "kv_blocks": sum(p["blocks"] for p in decode),
        "ttft_p50": pct(run.ttft, 0.5), "ttft_p99": pct(run.ttft, 0.99), "e2e_p50": pct(run.e2e, 0.5),
        "decisions": delta["decisions"], "routed": delta["routed"],
        "per_pod": {k: (p["hits"] / p["queries"] if p["queries"] else 0.0) for k, p in sorted(pods.items())},
    }


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':<12} {'reqs':>5} {'hit rate':>9} {'dec hit':>8} {'KV MiB':>9} {'blocks':>7} "
             f"{'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>8} {'local':>6} {'remote':>7} {'wall s':>7}"]
    for r in rows:
        lines.append(f"{r['mode']:<12} {r['requests']:>5} {r['hit_rate']:>9.1%} {r['decode_hit_rate']:>8.1%} "
                     f"{r['kv_bytes'] / 2**20:>9.1f} {r['kv_blocks']:>7} {r['ttft_p50']:>8.3f}s {r['ttft_p99']:>8.3f}s "
                     f"{r['e2e_p50']:>7.2f}s {r['decisions'].get('local', 0):>6.0f} "
                     f"{r['decisions'].get('remote', 0):>7.0f} {r['wall_s']:>7.1f}")
    return "\n".join(lines)


@click.command("kv-routing")
@click.option("--users", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--turns", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--system-tokens", type=click.IntRange(min=16), default=1000, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True, help="Answer length cap.")
@click.option("--user-interval-s", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="User k starts its first turn k x this many seconds in (arrivals, as a chat service sees them).")
@click.option("--local-prefill-threshold", type=click.IntRange(min=0), default=128, show_default=True,
              help="Router flag, same in both modes (kv: uncached suffix; round-robin: whole prompt).")
@click.option("--kv-cache-memory", default="512MiB", show_default=True, help="Per worker.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--modes", default="round_robin,kv", show_default=True)
@click.option("--startup-timeout-s", type=float, default=600.0, show_default=True)
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep every service's log here (one folder per mode) [default: a temporary folder].")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None, help="Also write the figures as JSON.")
def kv_routing_command(users, turns, system_tokens, max_tokens, user_interval_s, local_prefill_threshold, kv_cache_memory, dtype,
                       modes, startup_timeout_s, log_dir, json_out) -> None:
    """Multi-turn chat through `pdserve up --prefill 1 --decode 2`, round-robin vs KV-aware routing."""
    from transformers import AutoTokenizer

    from pdserve.shared.models.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    system = system_prompt(tokenizer, system_tokens)
    args = ["--prefill", "1", "--decode", "2", "--dtype", dtype, "--kv-cache-memory", kv_cache_memory,
            "--local-prefill-threshold", str(local_prefill_threshold)]
    click.echo(f"workload: {users} users x {turns} turns, system prompt {len(tokenizer.encode(system))} tokens, "
               f"answers <= {max_tokens} tokens, users {user_interval_s:g} s apart; pdserve up {' '.join(args)}", err=True)
    rows = []
    for mode in modes.split(","):
        click.echo(f"running {mode} ...", err=True)
        rows.append(measure(mode, args, users, turns, system, max_tokens, user_interval_s, startup_timeout_s,
                            log_dir))
        if rows[-1]["errors"]:
            click.echo(f"  {len(rows[-1]['errors'])} errors, first: {rows[-1]['errors'][0]}", err=True)
    click.echo(table(rows))
    by = {r["mode"]: r for r in rows}
    if "kv" in by and "round_robin" in by and by["round_robin"]["kv_bytes"]:
        rr, kv = by["round_robin"], by["kv"]
        click.echo(f"KV-aware / round-robin: bytes {kv['kv_bytes'] / rr['kv_bytes']:.1%} (target <= 40%), "
                   f"TTFT p50 {kv['ttft_p50']:.3f}s vs {rr['ttft_p50']:.3f}s (target: lower)")
    for r in rows:
        click.echo(f"{r['mode']}: per-pod prefix hit rate " +
                   ", ".join(f"{k} {v:.1%}" for k, v in r["per_pod"].items()) +
                   "; requests per decode pod " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["routed"].items())))
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    kv_routing_command()
