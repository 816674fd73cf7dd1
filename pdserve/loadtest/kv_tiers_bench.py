"""Multi-turn chat against KV offloading tiers: no tiers, CPU, CPU+disk and an unlimited pool, in turns.

Modes: ``none`` (pool only), ``cpu`` (``--kv-offloading-size``), ``cpu+disk`` (a CPU tier of ``--cpu-size-with-disk``
GiB, smaller than the working set, so that evictions reach the disk tier), ``unlimited`` (a 2 GiB pool: the floor);
``cpu-st2`` and ``cpu+disk-st2`` are ``cpu`` and ``cpu+disk`` with the admission gate
(``--kv-offloading-store-threshold 2``: a block is written down only once it was looked up twice).

Workload: ``--sessions`` chat sessions share one system prompt (``--system-tokens``); each runs ``--turns`` turns
in sequence, turn k+1 carrying the whole conversation so far (answers included). Every session's first turn
goes out, then every second turn, and so on: between two turns of one session the other sessions pass through
the pod, so with a small pool (``--kv-cache-memory``) a session's history is evicted before it comes back. Each
mode runs a fresh ``pdserve up --prefill 1 --decode 1`` (same flags but the tiers); ``--rounds`` repeats the
modes in turns (A B C D A B C D). By default every turn goes through the prefill pod and the hand-over;
``--local-prefill-threshold N`` lets a turn with at most N tokens left to compute on its decode pod (past the
blocks the pod holds in any medium) prefill there, as llm-d's ``pd-profile-handler`` threshold does. Figures per mode, over later turns (turn 2 on):

* TTFT p50/p99 as the client sees it, and E2E latency p50/p99 (the last token: the decode pod's side, where a
  hand-over's reservation and its tier loads sit; TTFT is the prefill pod's first token, sent before the hand-over);
* prompt tokens computed per later turn (prefill and decode pods: ``prompt_tokens_computed``) next to the new
  tokens of that turn (the prompt minus the previous turn's prompt and answer);
* KV bytes moved: over the KV connector (``kv_bytes_received``), and written to / loaded from the tiers (disk's
  share apart), and evicted blocks the admission gate did not write (``stores_skipped``).

``--one-shot K`` mixes churn in: after each session's turn, K one-shot prompts (the shared system prompt and a
unique question of about ``--one-shot-tokens`` tokens) whose blocks never come back; they are load, not figures.
The working set (the system prompt plus every session's final history, one-shots excluded) is printed against the
decode pod's pool.

Run: ``pdserve bench multi-turn [--sessions 10 --turns 3]``; figures in pdserve/loadtest/README.md
"KV offloading tiers". ``--tree NAME=PATH`` (repeatable) runs each mode from several checkouts in turns (``pdserve
up`` imports pdserve from PATH), e.g. ``--tree main=/work/main --tree branch=.``; the rows are ``mode@NAME``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import click
import httpx

from pdserve.loadtest.cluster import Cluster
from pdserve.loadtest.kv_routing_bench import MODEL, pct, system_prompt, user_message
from pdserve.loadtest.pd_compare import pd_decisions
from pdserve.loadtest.sse import aread_chunks

MODES = ("none", "cpu", "cpu+disk", "unlimited")
ALL_MODES = (*MODES, "cpu-st2", "cpu+disk-st2")
STAT_KEYS = ("prompt_tokens_computed", "kv_bytes_received", "kv_offload_cpu_bytes_written",
             "kv_offload_cpu_bytes_loaded", "kv_offload_disk_bytes_written", "kv_offload_disk_bytes_loaded",
             "kv_offload_cpu_stores_skipped", "kv_offload_disk_stores_skipped")


def mode_args(mode: str, kv_cache_memory: str, cpu_gib: float, disk_gib: float, disk_path: str,
              cpu_gib_with_disk: float) -> list[str]:
    """``pdserve up`` flags of one mode (the pool is shrunk for all but ``unlimited``)."""
    if mode not in ALL_MODES:
        raise ValueError(f"unknown mode {mode!r} (one of {', '.join(ALL_MODES)})")
    if mode == "unlimited":
        return ["--kv-cache-memory", "2GiB"]
    args = ["--kv-cache-memory", kv_cache_memory]
    base = mode.removesuffix("-st2")
    if base == "cpu":
        args += ["--kv-offloading-size", str(cpu_gib)]
    elif base == "cpu+disk":
        args += ["--kv-offloading-size", str(cpu_gib_with_disk), "--kv-offloading-disk-path", disk_path,
                 "--kv-offloading-disk-size", str(disk_gib)]
    if mode.endswith("-st2"):
        args += ["--kv-offloading-store-threshold", "2"]
    return args


def turn_message(session: int, turn: int, extra_tokens: int) -> str:
    """The user's message of one turn: ``user_message`` plus, with ``extra_tokens``, a pasted detail of about that
    many tokens unique to the session and turn (real chat turns carry documents, code, logs), so that the new
    tokens of a turn are not dwarfed by the partial block a block-granular prefix cache recomputes."""
    text = user_message(session, turn)
    if extra_tokens <= 0:
        return text
    words = " ".join(f"s{session}t{turn}w{j}" for j in range(max(1, extra_tokens // 7)))
    return f"{text} Here are my notes: {words}"


def one_shot_message(i: int, n_tokens: int) -> str:
    """A unique question of about ``n_tokens`` tokens (its blocks are nobody else's)."""
    words = " ".join(f"item{i}x{j}" for j in range(max(1, n_tokens // 4)))
    return f"One-off request {i}: sort these labels and say which is first: {words}"


async def one_turn(http: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> tuple[float, str, int, float]:
    """(TTFT s, answer, prompt tokens, E2E s) of one streamed chat turn; raises on an HTTP error."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, answer, prompt_tokens = time.perf_counter(), None, [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for chunk in aread_chunks(resp.aiter_lines()):
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    first = first if first is not None else time.perf_counter() - start
                    answer.append(choice["delta"]["content"])
    e2e = time.perf_counter() - start
    return (first if first is not None else e2e), "".join(answer), prompt_tokens, e2e


async def workload(router_url: str, sessions: int, turns: int, system: str, max_tokens: int, stats_of,
                   one_shot: int = 0, one_shot_tokens: int = 200, system_tokens: int = 0,
                   user_tokens: int = 0) -> dict:
    """Turn by turn across sessions; per later turn: TTFT, new tokens, prompt tokens computed (the pods' counter
    moved by that turn alone: turns of one round go one at a time). ``one_shot`` churn prompts follow each turn.
    ``working_set``: tokens of the system prompt (``system_tokens``) plus every session's last prompt and answer
    beyond it."""
    histories = [[{"role": "system", "content": system}] for _ in range(sessions)]
    last_kv = [0] * sessions  # tokens of the previous turn's prompt and answer
    out = {"ttft": [], "e2e": [], "new": [], "computed": [], "local": 0, "one_shots": 0}
    async with httpx.AsyncClient(base_url=router_url, timeout=httpx.Timeout(600.0)) as http:
        for turn in range(turns):
            for s in range(sessions):
                histories[s].append({"role": "user", "content": turn_message(s, turn, user_tokens)})
                before = await stats_of()
                ttft, answer, prompt_tokens, e2e = await one_turn(http, histories[s], max_tokens)
                after = await stats_of()
                histories[s].append({"role": "assistant", "content": answer})
                if turn:
                    out["ttft"].append(ttft)
                    out["e2e"].append(e2e)
                    out["new"].append(prompt_tokens - last_kv[s])
                    out["computed"].append(after["prompt_tokens_computed"] - before["prompt_tokens_computed"])
                    out["local"] += after.get("local_prefills", 0) > before.get("local_prefills", 0)
                last_kv[s] = prompt_tokens + max_tokens
                for _ in range(one_shot):
                    msgs = [{"role": "system", "content": system},
                            {"role": "user", "content": one_shot_message(out["one_shots"], one_shot_tokens)}]
                    await one_turn(http, msgs, max_tokens)
                    out["one_shots"] += 1
    out["working_set"] = system_tokens + sum(k - system_tokens for k in last_kv)
    return out


def pod_stats(up: Cluster) -> dict:
    """``STAT_KEYS`` summed over the worker pods (their ``/v1/stats``), and ``pool_blocks``: the largest pod's pool."""
    pods = httpx.get(f"{up.registry_url}/v1/pods", headers={"Authorization": f"Bearer {up.registry_token}"},
                     timeout=10).json()["pods"]
    total = dict.fromkeys(STAT_KEYS, 0)
    total["pool_blocks"] = 0
    for p in pods:
        s = httpx.get(f"http://{p['host']}:{p['http_port']}/v1/stats", timeout=30).json()
        for k in STAT_KEYS:
            total[k] += s.get(k, 0)
        total["pool_blocks"] = max(total["pool_blocks"], s.get("kv_blocks_total", 0))
    total["local_prefills"] = sum(n for k, n in pd_decisions(up.router_url).items() if k.startswith("local/"))
    return total


def measure(mode: str, base: list[str], mode_flags: list[str], sessions: int, turns: int, system: str,
            max_tokens: int, timeout_s: float, one_shot: int = 0, one_shot_tokens: int = 200,
            system_tokens: int = 0, block_size: int = 16, tree: str | None = None, user_tokens: int = 0) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"pdserve-tiers-{mode.replace('+', '-')}-") as tmp:
        flags = [f.replace("{tmp}", tmp) for f in mode_flags]
        with Cluster(*base, *flags, log_dir=Path(tmp), timeout_s=timeout_s, process=True,
                     serving_model=MODEL, pythonpath=tree) as up:
            start = pod_stats(up)
            run = asyncio.run(workload(up.router_url, sessions, turns, system, max_tokens,
                                       lambda: asyncio.to_thread(pod_stats, up), one_shot, one_shot_tokens,
                                       system_tokens, user_tokens))
            end = pod_stats(up)
    moved = {k: end[k] - start[k] for k in STAT_KEYS if k != "prompt_tokens_computed"}
    return {"mode": mode, "turns": len(run["ttft"]), "ttft_p50": pct(run["ttft"], 0.5),
            "ttft_p99": pct(run["ttft"], 0.99), "e2e_p50": pct(run["e2e"], 0.5), "e2e_p99": pct(run["e2e"], 0.99),
            "computed_per_turn": statistics.mean(run["computed"]),
            "new_per_turn": statistics.mean(run["new"]), "local_turns": run["local"], "moved": moved, "one_shots": run["one_shots"],
            "working_set_tokens": run["working_set"], "pool_tokens": end["pool_blocks"] * block_size}


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':<18} {'turns':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9} {'E2E p99':>9} {'computed':>9} {'new':>6} {'ratio':>6} "
             f"{'local':>5} {'wire MiB':>9} {'tier wr MiB':>11} {'(disk)':>7} {'tier ld MiB':>11} {'(disk)':>7} {'skipped':>7}"]
    for r in rows:
        m = r["moved"]
        written = (m["kv_offload_cpu_bytes_written"] + m["kv_offload_disk_bytes_written"]) / 2**20
        loaded = (m["kv_offload_cpu_bytes_loaded"] + m["kv_offload_disk_bytes_loaded"]) / 2**20
        skipped = m.get("kv_offload_cpu_stores_skipped", 0) + m.get("kv_offload_disk_stores_skipped", 0)
        lines.append(f"{r['mode']:<18} {r['turns']:>5} {r['ttft_p50']:>8.3f}s {r['ttft_p99']:>8.3f}s "
                     f"{r.get('e2e_p50', float('nan')):>8.3f}s {r.get('e2e_p99', float('nan')):>8.3f}s "
                     f"{r['computed_per_turn']:>9.1f} {r['new_per_turn']:>6.1f} "
                     f"{r['computed_per_turn'] / r['new_per_turn']:>6.2f} {r.get('local_turns', 0):>5} "
                     f"{m['kv_bytes_received'] / 2**20:>9.1f} "
                     f"{written:>11.1f} {m['kv_offload_disk_bytes_written'] / 2**20:>7.1f} {loaded:>11.1f} "
                     f"{m['kv_offload_disk_bytes_loaded'] / 2**20:>7.1f} {skipped:>7}")
    return "\n".join(lines)


@click.command("multi-turn")
@click.option("--sessions", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--turns", type=click.IntRange(min=2), default=3, show_default=True)
@click.option("--system-tokens", type=click.IntRange(min=16), default=1000, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True, help="Answer length cap.")
@click.option("--kv-cache-memory", default="24MiB", show_default=True,
              help="Decode and prefill pool of every mode but unlimited (2GiB).")
@click.option("--kv-offloading-size", "cpu_gib", type=float, default=1.0, show_default=True,
              help="CPU tier GiB (cpu modes).")
@click.option("--cpu-size-with-disk", "cpu_gib_with_disk", type=float, default=0.03, show_default=True,
              help="CPU tier GiB in the cpu+disk modes: smaller than the working set, so that blocks reach the disk.")
@click.option("--kv-offloading-disk-size", "disk_gib", type=float, default=4.0, show_default=True)
@click.option("--user-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="About this many more tokens in each user turn (a pasted note unique to the session and turn).")
@click.option("--local-prefill-threshold", type=click.IntRange(min=0), default=0, show_default=True,
              help="pdserve up's: a turn whose uncached part on the chosen decode pod (any tier) is at most this many "
                   "tokens prefills there (llm-d's pd-profile-handler threshold); 0: every turn goes through the "
                   "prefill pod and the hand-over.")
@click.option("--one-shot", type=click.IntRange(min=0), default=0, show_default=True,
              help="Churn: one-shot prompts after each session's turn (their blocks never come back).")
@click.option("--one-shot-tokens", type=click.IntRange(min=8), default=200, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="bfloat16", show_default=True)
@click.option("--modes", default=",".join(MODES), show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Repeat the modes in turns (A B C D A B C D).")
@click.option("--startup-timeout-s", type=float, default=600.0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None, help="Also write the figures as JSON.")
@click.option("--tree", "trees", multiple=True,
              help="NAME=PATH: also run each mode from this checkout (`pdserve up` imports pdserve from PATH), in turns.")
def multi_turn_command(sessions, turns, system_tokens, max_tokens, kv_cache_memory, cpu_gib, cpu_gib_with_disk,
                       disk_gib, user_tokens, local_prefill_threshold, one_shot, one_shot_tokens, dtype, modes, rounds, startup_timeout_s, json_out,
                       trees) -> None:
    """Multi-turn chat through `pdserve up`: no tiers vs CPU vs CPU+disk vs an unlimited pool, in turns."""
    from transformers import AutoTokenizer

    from pdserve.shared.models.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    system = system_prompt(tokenizer, system_tokens)
    # local prefill threshold 0 (the default): every later turn goes through the prefill pod, so that the hand-over
    # (and the decode pod's tiers answering its reservation) is what is measured. Above 0, a turn whose history the
    # chosen decode pod holds (pool or tiers) prefills there: the prefill pod never held the previous answer's KV
    # (the decode pod computed it), so through the hand-over it recomputes that answer and the partial last block.
    base = ["--prefill", "1", "--decode", "1", "--dtype", dtype,
            "--local-prefill-threshold", str(local_prefill_threshold)]
    # the system turn as the chat template renders it (tokenize=True may return a BatchEncoding, not ids)
    shared = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                                                tokenize=False), add_special_tokens=False))
    click.echo(f"workload: {sessions} sessions x {turns} turns, system prompt {len(tokenizer.encode(system))} tokens, "
               f"answers <= {max_tokens} tokens, user turns +~{user_tokens} tokens, {one_shot} one-shot prompts of ~{one_shot_tokens} tokens after each "
               f"turn; pdserve up {' '.join(base)}", err=True)
    for mode in modes.split(","):
        mode_args(mode, kv_cache_memory, cpu_gib, disk_gib, "", cpu_gib_with_disk)  # an unknown mode fails now
    checkouts = [tuple(t.split("=", 1)) for t in trees] or [(None, None)]
    if any(len(c) != 2 for c in checkouts):
        raise click.BadParameter("NAME=PATH", param_hint="--tree")
    rows = []
    for r in range(rounds):
        for mode, (name, path) in [(m, c) for m in modes.split(",") for c in checkouts]:
            label = mode if name is None else f"{mode}@{name}"
            click.echo(f"round {r + 1}: {label} ...", err=True)
            flags = mode_args(mode, kv_cache_memory, cpu_gib, disk_gib, "{tmp}/kv-disk", cpu_gib_with_disk)
            rows.append(measure(mode, base, flags, sessions, turns, system, max_tokens, startup_timeout_s, one_shot,
                                one_shot_tokens, shared, tree=path, user_tokens=user_tokens))
            rows[-1]["mode"] = label
            r_ = rows[-1]
            r_["load"] = os.getloadavg()[0]
            click.echo(f"{table(rows[-1:]).splitlines()[1]}   working set {r_['working_set_tokens']} tokens = "
                       f"{r_['working_set_tokens'] / max(1, r_['pool_tokens']):.1f}x the pool "
                       f"({r_['pool_tokens']} tokens); load {os.getloadavg()[0]:.1f}", err=True)
    click.echo(table(rows))
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=2))
