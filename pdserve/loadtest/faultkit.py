"""The kit that the fault benchmarks share (``chaos``, ``faults``, ``overload``): the local ensemble
(``cluster.Cluster``, re-exported here) and what finished requests may not leave in it (``leftovers``), a client
that records what each request got (``completion``, ``Outcome``), and the tally of a scenario (``Tally``,
``table``). It imports none of them, so they depend on it and never on each other
(pyproject.toml's import-linter contract "loadtest: the fault benchmarks share faultkit").
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import redis as redis_sync

from pdserve.loadtest.cluster import Cluster as Cluster
from pdserve.loadtest.cluster import wait_for as wait_for
from pdserve.loadtest.sse import StrictSSE
from pdserve.shared.protocol import keys

MODEL = "smollm2-135m-instruct"


def leftovers(cluster: Cluster) -> dict[str, Any]:
    """What finished requests may not leave behind: blocks, leases, pending queue entries, output streams."""
    r = cluster.redis()
    try:
        out_streams = [k.decode() for k in r.scan_iter(match=keys.OUTPUT_STREAMS_MATCH, count=1000)]
        try:
            pending = r.xpending(keys.PREFILL_STREAM, keys.PREFILL_GROUP)["pending"]
        except redis_sync.ResponseError:
            pending = 0
    finally:
        r.close()
    decode = {}
    for name in cluster.names("decode"):
        s = cluster.stats(name)
        decode[name] = {k: s.get(k) for k in ("kv_blocks_used", "kv_active_leases", "num_running", "num_waiting",
                                              "requests_tracked")}
    prefill = {}
    for name in cluster.names("prefill"):
        s = cluster.stats(name)
        prefill[name] = {k: s.get(k) for k in ("num_running", "num_waiting", "requests_tracked")}
    return {"output_streams": out_streams, "pending": pending, "decode": decode, "prefill": prefill}


# ---- the client ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What one request got. ``kind``: completed | clear_error | lost; ``wrong``: completed, but not the
    expected text (or a token count that does not match the text the client received)."""

    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: dict[str, Any] | None = None
    latency_s: float = 0.0
    done: bool = False  # saw [DONE] (stream) or a whole body
    exception: str | None = None
    retry_after: str | None = None
    wrong: bool = False
    ttft_s: float | None = None  # time to the first text chunk (streamed requests)

    @property
    def kind(self) -> str:
        if self.exception is None and self.error is None and self.status == 200 and self.done \
                and self.finish_reason in ("stop", "length"):
            return "completed"
        if self.error is not None and self.error.get("message") and (self.status != 200 or self.done):
            return "clear_error"
        return "lost"


async def completion(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, stream: bool = True,
                     disconnect_after: int | None = None, on_token: Callable[[int], None] | None = None,
                     **extra: Any) -> Outcome:
    """One greedy ``/v1/completions`` request. ``disconnect_after``: hang up after that many text chunks
    (an abort storm's client); ``on_token(n)`` is called with the number of text chunks received so far."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    out = Outcome()
    started = time.monotonic()
    try:
        if not stream:
            resp = await client.post(f"{url}/v1/completions", json=body)
            out.status = resp.status_code
            out.retry_after = resp.headers.get("retry-after")
            data = resp.json()
            if resp.status_code == 200:
                out.text = data["choices"][0]["text"]
                out.finish_reason = data["choices"][0]["finish_reason"]
                out.completion_tokens = data["usage"]["completion_tokens"]
                out.done = True
            else:
                out.error = data.get("error")
            return out
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status_code
            out.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                await resp.aread()
                out.error = resp.json().get("error")
                return out
            chunks = 0
            sse = StrictSSE()  # a line vLLM's benchmark could not read fails the request (SSEProtocolError)
            async for line in resp.aiter_lines():
                data = sse.feed(line)
                if sse.done:
                    out.done = True
                    break
                if data is None:
                    continue
                if "error" in data:
                    out.error = data["error"]
                    continue
                if data.get("usage"):
                    out.completion_tokens = data["usage"]["completion_tokens"]
                for choice in data.get("choices") or []:
                    if choice.get("text"):
                        if out.ttft_s is None:
                            out.ttft_s = time.monotonic() - started
                        out.text += choice["text"]
                        chunks += 1
                        if on_token is not None:
                            on_token(chunks)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                if disconnect_after is not None and chunks >= disconnect_after:
                    out.exception = "disconnected by the client"
                    return out
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as exc:
        out.exception = f"{type(exc).__name__}: {exc}"
    finally:
        out.latency_s = time.monotonic() - started
    return out


def prompts(n: int, words: int = 120, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of about ``words`` words (different from the first word, so no shared prefix)."""
    rng = random.Random(seed)
    vocab = ("river mountain cloud lantern harbor meadow copper violet engine garden silver winter orbit "
             "canyon forest marble signal thunder pepper falcon quartz ember island velvet").split()
    return [f"Story {i}: " + " ".join(rng.choice(vocab) for _ in range(words)) + "\nSummary:" for i in range(n)]


# ---- the tally -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    scenario: str
    outcomes: list[Outcome] = field(default_factory=list)
    note: str = ""
    leaked: str = "-"  # what was not back to its baseline once the ensemble was quiet ("0"; "-": not measured)
    failures: list[str] = field(default_factory=list)  # expectations the scenario saw broken (fail the run)

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)

    @property
    def wrong(self) -> int:
        return sum(1 for o in self.outcomes if o.kind == "completed" and o.wrong)

    def p99(self) -> float | None:
        lat = sorted(o.latency_s for o in self.outcomes if o.kind == "completed")
        if not lat:
            return None
        return lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]

    def row(self) -> list[str]:
        p99 = self.p99()
        note = "; ".join(x for x in (*(f"FAILED: {f}" for f in self.failures), self.note) if x)
        return [self.scenario, str(self.sent), str(self.count("completed")), str(self.count("clear_error")),
                str(self.count("lost")), self.leaked, str(self.wrong), "-" if p99 is None else f"{p99:.2f}", note]


def table(tallies: list[Tally]) -> str:
    head = ["scenario", "sent", "completed", "clear errors", "lost", "leaked", "wrong", "p99 s", "note"]
    rows = [head] + [t.row() for t in tallies]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def errors_note(outcomes: list[Outcome]) -> str:
    """What the clear errors were, grouped: ``"3x 503 ServiceUnavailableError 'No decode pod ...'"``."""
    groups: dict[str, int] = {}
    for o in outcomes:
        if o.kind == "clear_error" and o.error:
            code = o.error.get("code") or o.status
            key = f"{code} {o.error.get('type')} {str(o.error.get('message'))[:90]!r}"
            groups[key] = groups.get(key, 0) + 1
    return "; ".join(f"{n}x {k}" for k, n in sorted(groups.items(), key=lambda kv: -kv[1]))
