"""The fault rows of ``pdserve bench chaos`` (rows 1 and 6-11, numbered as the fault list they came from), and the leak check every row ends with.

Each scenario injects one fault into a real ensemble (``faultkit.Cluster``, or ``pdserve up`` itself for item 8),
sends requests to 127.0.0.1 only, and gives every request a bound: one with no answer within it counts as lost.
After each row, once the ensemble is quiet, :func:`leaks` compares what the pods, Redis and the routers still
hold with what they held before the fault (``leaked`` column):

- decode and prefill pods (``/v1/stats``): ``kv_blocks_used`` (a freed block that stays in the prefix cache is
  free, so this returns to its baseline), ``kv_active_leases``, ``num_running``, ``num_waiting``,
  ``requests_tracked``; a pod that does not answer counts as ``unreachable``;
- Redis: pending entries (XPENDING) of the prefill queue and of every decode pod's own request stream, and
  output streams (``keys.OUTPUT_STREAMS_MATCH``) still holding events;
- every router (``/metrics``): ``pdserve:num_requests_running``.

    python -m pdserve.loadtest.chaos --only 1,6,7,8,9,10,11
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import httpx
import redis as redis_sync
from prometheus_client.parser import text_string_to_metric_families

from pdserve.loadtest import faultkit
from pdserve.loadtest.faultkit import Cluster, Outcome, Tally, completion, prompts, wait_for
from pdserve.shared import redis_client
from pdserve.shared.protocol import keys

POD_COUNTERS = ("kv_blocks_used", "kv_active_leases", "num_running", "num_waiting", "requests_tracked")


# ---- the leak check ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Probe:
    """Where an ensemble keeps state: its Redis, each worker's base URL, each router's base URL."""

    redis_url: str
    pods: dict[str, str]  # name -> http://host:port
    routers: list[str]

    @classmethod
    def of(cls, cluster: Cluster) -> Probe:
        pods = {name: url for name, url in cluster.urls.items() if name.startswith(("prefill-", "decode-"))}
        routers = [url for name, url in cluster.urls.items() if name.startswith("router")]
        return cls(cluster.redis_url, pods, routers)


def snapshot(probe: Probe) -> dict[str, int]:
    """Flat counters of what the ensemble holds now, e.g. ``{"decode-0 kv_blocks_used": 3, "prefill pending": 0}``."""
    out: dict[str, int] = {}
    with httpx.Client(timeout=5) as client:
        for name, url in probe.pods.items():
            try:
                stats = client.get(f"{url}/v1/stats").json()
            except (httpx.HTTPError, ValueError):
                out[f"{name} unreachable"] = 1
                continue
            for key in POD_COUNTERS:
                if isinstance(stats.get(key), int):
                    out[f"{name} {key}"] = stats[key]
        for url in probe.routers:
            try:
                text = client.get(f"{url}/metrics").text
            except httpx.HTTPError:
                out[f"router {url} unreachable"] = 1
                continue
            out[f"router {url} running"] = int(sum(
                s.value for f in text_string_to_metric_families(text) if f.name == "pdserve:num_requests_running"
                for s in f.samples))
    r = redis_client.connect(probe.redis_url, sync=True, socket_timeout=5)
    try:
        out["prefill queue pending"] = _pending(r, keys.PREFILL_STREAM, keys.PREFILL_GROUP)
        for key in r.scan_iter(match=keys.DECODE_STREAMS_MATCH, count=1000):
            out[f"{key.decode()} pending"] = _pending(r, key, keys.DECODE_GROUP)
        out["output streams"] = sum(1 for k in r.scan_iter(match=keys.OUTPUT_STREAMS_MATCH, count=1000)
                                    if r.xlen(k) > 0)
    except redis_sync.RedisError:
        out["redis unreachable"] = 1
    finally:
        r.close()
    return out


def _pending(r: redis_sync.Redis, stream: str | bytes, group: str) -> int:
    try:
        return int(r.xpending(stream, group)["pending"])
    except redis_sync.ResponseError:  # no such stream or group (e.g. after FLUSHALL): nothing pending
        return 0


def leaks(probe: Probe, baseline: dict[str, int], settle_s: float = 20.0) -> dict[str, int]:
    """What is above its ``baseline`` (a :func:`snapshot` from before the fault) once the ensemble had up to
    ``settle_s`` to become quiet; ``{}`` when everything came back."""
    def excess() -> dict[str, int]:
        now = snapshot(probe)
        return {k: v - baseline.get(k, 0) for k, v in now.items() if v > baseline.get(k, 0)}
    last: dict[str, int] = {}

    def quiet() -> bool:
        nonlocal last
        last = excess()
        return not last
    wait_for(quiet, settle_s, 0.5)
    return last


def leak_text(found: dict[str, int]) -> str:
    """The ``leaked`` cell: ``"0"``, or the leftovers, e.g. ``"decode-0 kv_blocks_used +12, output streams +2"``."""
    return "0" if not found else ", ".join(f"{k} +{v}" for k, v in sorted(found.items()))


# ---- helpers -------------------------------------------------------------------------------------------------


async def bounded(request: Awaitable[Outcome], bound_s: float) -> Outcome:
    """``request``'s outcome, or a lost one when it has no answer within ``bound_s`` seconds."""
    started = time.monotonic()
    try:
        return await asyncio.wait_for(request, bound_s)
    except asyncio.TimeoutError:
        return Outcome(exception=f"no answer within {bound_s:g} s", latency_s=time.monotonic() - started)


def client(n: int, bound_s: float) -> httpx.AsyncClient:
    """A client whose own timeouts never end a request before the scenario's bound does."""
    return httpx.AsyncClient(timeout=bound_s + 30, limits=httpx.Limits(max_connections=n + 16))


def mid_stream_errors(outcomes: list[Outcome]) -> int:
    """Requests answered 200 whose stream then carried an error chunk."""
    return sum(1 for o in outcomes if o.status == 200 and o.error is not None)


def note(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def lost_note(outcomes: list[Outcome]) -> str:
    """What the lost requests got, grouped: ``"lost: 3x no answer within 90 s, 1x 200 without [DONE]"``."""
    groups: dict[str, int] = {}
    for o in outcomes:
        if o.kind == "lost":
            why = (o.exception or (f"{o.status} error {str((o.error or {}).get('message'))[:60]!r}" if o.error
                                   else f"{o.status} without [DONE]" if not o.done else
                                   f"{o.status} finish_reason {o.finish_reason}"))[:90]
            groups[why] = groups.get(why, 0) + 1
    return "lost: " + ", ".join(f"{k}x {w}" for w, k in sorted(groups.items(), key=lambda kv: -kv[1])) \
        if groups else ""


def outcome_notes(outcomes: list[Outcome]) -> str:
    return note(faultkit.errors_note(outcomes), lost_note(outcomes))


async def wait_ready(url: str, timeout_s: float) -> float | None:
    """Seconds until ``url`` answers 200, or None after ``timeout_s``."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=2) as c:
        while time.monotonic() - started < timeout_s:
            try:
                if (await c.get(url)).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    return None


async def recovery(url: str, timeout_s: float, words: int = 20) -> float | None:
    """Seconds until a one-at-a-time probe request completes again, or None after ``timeout_s``."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        i = 0
        while time.monotonic() - started < timeout_s:
            probe = await bounded(completion(c, url, prompts(1, words=words, seed=900 + i)[0], 4), 10)
            if probe.kind == "completed":
                return time.monotonic() - started
            i += 1
            await asyncio.sleep(0.5)
    return None


def _seconds(value: float | None, bound_s: float) -> str:
    return f"in {value:.1f} s" if value is not None else f"not within {bound_s:g} s"


# ---- item 1: a full decode KV cache ---------------------------------------------------------------------------


async def kv_cache_full(cluster: Cluster, n: int, max_tokens: int = 48, bound_s: float = 180.0) -> Tally:
    """``n`` streamed requests at once, each needing ~7 blocks (a ~55-token prompt, ``max_tokens`` generated),
    against a decode pod whose pool holds a few of them: every one completes or gets 429, none an error
    mid-stream."""
    texts = prompts(n, words=40, seed=11)
    async with client(n, bound_s) as c:
        outcomes = await asyncio.gather(*[bounded(completion(c, cluster.router_url, p, max_tokens,
                                                             ignore_eos=True), bound_s) for p in texts])
    stats = [cluster.stats(d) for d in cluster.names("decode")]
    tally = Tally("1 decode KV cache full", list(outcomes))
    mid = mid_stream_errors(tally.outcomes)
    if mid:
        tally.failures.append(f"{mid} errors mid-stream")
    tally.note = note(f"{n} x {max_tokens} tokens at once; decode pool "
                      + ", ".join(f"{s.get('kv_blocks_total')} blocks (peak {s.get('peak_kv_blocks_used')}, "
                                  f"{s.get('num_preemptions')} preemptions, {s.get('generation_tokens')} tokens "
                                  f"generated)" for s in stats),
                      outcome_notes(tally.outcomes))
    return tally


# ---- item 6: Redis loses its data -----------------------------------------------------------------------------


async def redis_data_loss(cluster: Cluster, n: int, how: str, max_tokens: int = 32, bound_s: float = 60.0,
                          recover_s: float = 30.0) -> Tally:
    """``n`` streams in flight when Redis loses everything (``how``: ``flushall``, or ``kill`` = SIGKILL and
    start it again empty, as ``pdserve up``'s Redis without persistence); then ``n`` more once a probe request
    completes again. Each request is answered or fails clearly within ``bound_s`` -- counted from the fault for
    the streams in flight (waiting for their first tokens can take most of a minute on a busy machine, and that
    wait is no part of the fault) -- and recovery within ``recover_s``."""
    progress = [0] * n
    texts = prompts(2 * n, words=30, seed=60 if how == "flushall" else 61)
    async with client(2 * n, bound_s + 60) as c:
        tasks = [asyncio.create_task(completion(c, cluster.router_url, p, max_tokens, ignore_eos=True,
                                                on_token=lambda k, i=i: progress.__setitem__(i, k)))
                 for i, p in enumerate(texts[:n])]
        await _until(lambda: min(progress) >= 1 or all(t.done() for t in tasks), 60)
        started = time.monotonic()
        tasks = [asyncio.create_task(bounded(t, bound_s)) for t in tasks]
        if how == "flushall":
            r = cluster.redis()
            r.flushall()
            r.close()
        else:
            redis_child = cluster.child("redis")
            redis_child.signal_group(signal.SIGKILL)
            redis_child.proc.wait(30)
            redis_child.start()
        recovered = await recovery(cluster.router_url, recover_s)
        after = [asyncio.create_task(bounded(completion(c, cluster.router_url, p, max_tokens), bound_s))
                 for p in texts[n:]]
        outcomes = await asyncio.gather(*tasks, *after)
    label = "FLUSHALL" if how == "flushall" else "SIGKILL, restarted empty"
    tally = Tally(f"6 Redis {label} mid-load", list(outcomes))
    if recovered is None:
        tally.failures.append(f"no request completed within {recover_s:g} s of the fault")
    tally.note = note(f"{n} streaming at the fault, {n} after; "
                      + (f"a new request completed {recovered:.1f} s after it" if recovered is not None else "")
                      + f" ({time.monotonic() - started:.0f} s to the last answer)", outcome_notes(tally.outcomes))
    return tally


async def _until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# ---- item 7: the router's SIGTERM ---------------------------------------------------------------------------


async def router_sigterm(cluster: Cluster, n: int, max_tokens: int = 64, bound_s: float = 90.0,
                         restart_timeout_s: float = 120.0) -> Tally:
    """SIGTERM the router while ``n`` streams are in flight (each has 2 tokens); 0.3 s later ``n`` new requests
    arrive. Streams in flight finish or end with an error chunk; new ones get 503 (connection refused once the
    router is gone counts as lost: no answer). The router is started again afterwards."""
    router = cluster.child("router")
    progress = [0] * n
    texts = prompts(2 * n, words=30, seed=70)
    async with client(2 * n, bound_s) as c:
        tasks = [asyncio.create_task(bounded(completion(c, cluster.router_url, p, max_tokens, ignore_eos=True,
                                                        on_token=lambda k, i=i: progress.__setitem__(i, k)),
                                             bound_s)) for i, p in enumerate(texts[:n])]
        await _until(lambda: min(progress) >= 2 or all(t.done() for t in tasks), 60)
        router.signal_group(signal.SIGTERM)
        term = time.monotonic()
        await asyncio.sleep(0.3)
        new = [asyncio.create_task(bounded(completion(c, cluster.router_url, p, max_tokens), bound_s))
               for p in texts[n:]]
        in_flight = await asyncio.gather(*tasks)
        fresh = await asyncio.gather(*new)
    exited = await asyncio.to_thread(wait_for, lambda: router.exited() is not None, restart_timeout_s, 0.2)
    took = time.monotonic() - term
    if not exited:
        router.signal_group(signal.SIGKILL)
        router.proc.wait(30)
    router.start()
    ready = await wait_ready(router.health_url, restart_timeout_s)
    tally = Tally("7 router SIGTERM mid-stream", [*in_flight, *fresh])
    refused = sum(1 for o in fresh if o.status == 503 and o.error and o.retry_after)
    cut = sum(1 for o in in_flight if o.kind == "lost")
    if cut:
        tally.failures.append(f"{cut} streams in flight cut without an error chunk")
    if ready is None:
        tally.failures.append("the router did not start again")
    tally.note = note(f"{n} in flight: {sum(o.kind == 'completed' for o in in_flight)} finished; {n} new: "
                      f"{refused} x 503 + Retry-After; router exited {took:.1f} s after SIGTERM"
                      if exited else f"router still up {restart_timeout_s:g} s after SIGTERM (SIGKILLed)",
                      outcome_notes(tally.outcomes))
    return tally


# ---- item 9: a hung (SIGSTOPped) prefill worker ------------------------------------------------------------------


async def prefill_sigstop(cluster: Cluster, n: int, max_tokens: int = 16, bound_s: float = 90.0,
                          hold_s: float = 4.0) -> Tally:
    """SIGSTOP every prefill worker while it holds ``n`` queue entries (decode pods are stopped for up to
    ``hold_s`` meanwhile, so the KV hand-over cannot complete), then ``n`` new requests arrive. Each moves (to
    another prefill pod or a decode pod's local prefill) or fails clearly within ``bound_s``; the workers stay
    stopped until then."""
    prefill, decode = cluster.names("prefill"), cluster.names("decode")
    texts = prompts(2 * n, words=40, seed=90)
    r = cluster.redis()
    try:
        async with client(2 * n, bound_s) as c:
            cluster.pause(*decode)
            try:
                tasks = [asyncio.create_task(bounded(completion(c, cluster.router_url, p, max_tokens), bound_s))
                         for p in texts[:n]]
                await asyncio.to_thread(wait_for, lambda: _pending(r, keys.PREFILL_STREAM, keys.PREFILL_GROUP) >= n,
                                        hold_s)
                held = _pending(r, keys.PREFILL_STREAM, keys.PREFILL_GROUP)
                cluster.pause(*prefill)
            finally:
                cluster.resume(*decode)
            stopped = time.monotonic()
            await asyncio.sleep(1.0)
            new = [asyncio.create_task(bounded(completion(c, cluster.router_url, p, max_tokens), bound_s))
                   for p in texts[n:]]
            outcomes = await asyncio.gather(*tasks, *new)
            answered = max((o.latency_s for o in outcomes if o.kind != "lost"), default=0.0)
    finally:
        cluster.resume(*prefill)
        r.close()
    tally = Tally("9 prefill worker SIGSTOP", list(outcomes))
    tally.note = note(f"{held} entries held by the stopped worker, {n} new after 1 s; stopped "
                      f"{time.monotonic() - stopped:.0f} s; slowest answer {answered:.1f} s",
                      outcome_notes(tally.outcomes))
    return tally


# ---- item 10: a decode pod whose KV port accepts and never answers ------------------------------------------------


class SilentDecodePod:
    """Registers itself as a decode pod (a copy of a real one's registration, other id and ports) and heartbeats;
    its ``/health`` answers 200 and its KV port accepts connections and never sends a byte."""

    def __init__(self, cluster: Cluster, template: str, pod_id: str = "decode-silent") -> None:
        self.cluster, self.template, self.pod_id = cluster, template, pod_id
        token = cluster.child("registry").env.get("PDSERVE_REGISTRY_TOKEN")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.started_at = time.time()
        self.conns: list[asyncio.StreamWriter] = []
        self.servers: list[asyncio.AbstractServer] = []
        self.accepted = 0
        self._beat: asyncio.Task | None = None

    async def _kv(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.conns.append(writer)  # held open, never answered

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            body = json.dumps({"status": "ok", "pod_id": self.pod_id, "started_at": self.started_at}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self) -> SilentDecodePod:
        kv = await asyncio.start_server(self._kv, "127.0.0.1", 0)
        http = await asyncio.start_server(self._http, "127.0.0.1", 0)
        self.servers = [kv, http]
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as c:
            info = (await c.get(f"{self.cluster.registry_url}/v1/pods/{self.template}")).json()
        info.update(pod_id=self.pod_id, http_port=http.sockets[0].getsockname()[1],
                    kv_port=kv.sockets[0].getsockname()[1], started_at=self.started_at, num_running=0,
                    num_waiting=0, free_blocks=info.get("total_blocks", 0), last_heartbeat=None)
        self.info = info
        self._beat = asyncio.create_task(self._heartbeat())
        await asyncio.sleep(1.5)  # registered and seen by the router's pod list
        return self

    async def _heartbeat(self) -> None:
        async with httpx.AsyncClient(timeout=5, headers=self.headers) as c:
            while True:
                try:
                    await c.post(f"{self.cluster.registry_url}/v1/pods", json=self.info)
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)

    async def __aexit__(self, *exc: object) -> None:
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as c:
            try:
                await c.delete(f"{self.cluster.registry_url}/v1/pods/{self.pod_id}")
            except httpx.HTTPError:
                pass
        for w in self.conns:
            w.close()
        for s in self.servers:
            s.close()


async def silent_kv_port(cluster: Cluster, n: int, max_tokens: int = 16, bound_s: float = 90.0) -> Tally:
    """A pod registered as a decode pod whose KV port accepts and never answers, beside the real ones; ``n``
    requests, then ``n`` more once they are answered. Transfers to it time out, say why, and migrate; the
    router stops choosing it."""
    texts = prompts(2 * n, words=60, seed=100)  # long enough for a remote prefill (a KV transfer)
    async with SilentDecodePod(cluster, cluster.names("decode")[0]) as pod:
        async with client(n, bound_s) as c:
            first = await asyncio.gather(*[bounded(completion(c, cluster.router_url, p, max_tokens), bound_s)
                                           for p in texts[:n]])
            accepted = pod.accepted
            second = await asyncio.gather(*[bounded(completion(c, cluster.router_url, p, max_tokens), bound_s)
                                            for p in texts[n:]])
    tally = Tally("10 decode pod's KV port accepts, never answers", [*first, *second])
    slow = [o.latency_s for o in second if o.kind == "completed"]
    tally.note = note(f"{accepted} KV connections to it in the first {n}, {pod.accepted - accepted} in the next {n}"
                      + (f" (p50 {sorted(slow)[len(slow) // 2]:.1f} s)" if slow else ""),
                      outcome_notes(tally.outcomes))
    for o in tally.outcomes:
        if o.kind == "clear_error" and str(o.error.get("message", "")).rstrip().endswith(":"):
            tally.failures.append("an error without its reason")
            break
    return tally


# ---- item 11: a prompt list under admission limits -------------------------------------------------------------


async def prompt_list(url: str, max_queued: int, lists: tuple[int, ...] = (100, 100, 5000),
                      max_tokens: int = 4, bound_s: float = 60.0) -> Tally:
    """One ``/v1/completions`` per entry of ``lists``, each with that many prompts, all at once, against a router
    with ``--max-queued-requests max_queued``: a list longer than the limit gets 429 (or 400 naming ``prompt``),
    never a hang. A longer list that completes was admitted past the limit."""
    async with client(len(lists), bound_s) as c:
        outcomes = await asyncio.gather(*[bounded(completion(c, url, prompts(k, words=6, seed=110 + i), max_tokens,
                                                             stream=False), bound_s)
                                          for i, k in enumerate(lists)])
    tally = Tally(f"11 prompt lists of {'/'.join(map(str, lists))} (max {max_queued} queued)", list(outcomes))
    admitted = [k for k, o in zip(lists, outcomes) if k > max_queued and o.kind == "completed"]
    if admitted:
        tally.failures.append(f"lists of {admitted} prompts admitted past --max-queued-requests {max_queued}")
    tally.note = outcome_notes(tally.outcomes)
    return tally


# ---- item 8: the registry and the router killed under `pdserve up` --------------------------------------------


async def up_restarts(ens: Cluster, n: int, max_tokens: int = 32, bound_s: float = 90.0,
                      restart_timeout_s: float = 60.0) -> Tally:
    """Under ``pdserve up``: SIGKILL the registry while ``n`` streams are in flight, then ``n`` more requests once
    it answers again; then SIGKILL the router while ``n`` streams are in flight (their connections close with it:
    counted as clear errors, the client knows at once), and ``n`` more once it is back. ``up`` restarts both;
    nothing else is lost, and the decode pod does not keep generating for the router that died."""
    texts = prompts(4 * n, words=30, seed=80)
    outcomes: list[Outcome] = []
    notes: list[str] = []
    failures: list[str] = []
    registry_health = ens.registry_url + "/health"
    progress = [0] * n

    async def streams(c: httpx.AsyncClient, batch: list[str], long: bool) -> list[asyncio.Task]:
        progress[:] = [0] * n
        tasks = [asyncio.create_task(bounded(completion(c, ens.router_url, p, max_tokens * (8 if long else 1),
                                                        ignore_eos=True,
                                                        on_token=lambda k, i=i: progress.__setitem__(i, k)),
                                             bound_s)) for i, p in enumerate(batch)]
        await _until(lambda: min(progress) >= 2 or all(t.done() for t in tasks), 60)
        return tasks

    async with client(2 * n, bound_s) as c:
        # the registry
        tasks = await streams(c, texts[:n], long=False)
        old = ens.pid("registry")
        ens.kill("registry")
        await asyncio.sleep(0.5)
        back = await wait_ready(registry_health, restart_timeout_s)
        new_pid = ens.pid("registry")
        outcomes += await asyncio.gather(*tasks)
        if back is None or new_pid in (None, old):
            failures.append("registry not restarted")
        notes.append(f"registry back {_seconds(back, restart_timeout_s)}")
        outcomes += await asyncio.gather(*[bounded(completion(c, ens.router_url, p, max_tokens), bound_s)
                                           for p in texts[n:2 * n]])
        # the router
        tasks = await streams(c, texts[2 * n:3 * n], long=True)
        old = ens.pid("router")
        ens.kill("router")
        cut = await asyncio.gather(*tasks)
        for o in cut:  # a stream whose connection closed with the router: the client sees it at once
            if o.kind == "lost" and o.status == 200 and o.exception and \
                    o.exception.startswith(("RemoteProtocolError", "ReadError")):
                o.error = {"type": "ConnectionClosed", "message": "the router's SIGKILL closed the stream"}
                o.exception, o.done = None, True
        outcomes += cut
        back = await wait_ready(ens.router_url + "/health", restart_timeout_s)
        if back is None or ens.pid("router") in (None, old):
            failures.append("router not restarted")
        notes.append(f"router back {_seconds(back, restart_timeout_s)}")
        outcomes += await asyncio.gather(*[bounded(completion(c, ens.router_url, p, max_tokens), bound_s)
                                           for p in texts[3 * n:]])
    if ens.proc.poll() is not None:
        failures.append(f"pdserve up exited with status {ens.proc.returncode}")
    tally = Tally("8 registry SIGKILL, router SIGKILL (pdserve up)", outcomes, failures=failures)
    tally.note = note(f"{n} streaming at each kill, {n} after each; " + ", ".join(notes),
                      outcome_notes(tally.outcomes))
    return tally


# ---- the rows -------------------------------------------------------------------------------------------------


ITEMS = ("1", "6", "7", "8", "9", "10", "11")


def measured(probe: Callable[[], Probe], item: str, scenario: Callable[[], Awaitable[Tally]], settle_s: float,
             echo: Callable[[str], None]) -> Tally:
    """Run one scenario between a snapshot and the leak check; a scenario that raises becomes a failed row."""
    base = snapshot(probe())
    started = time.monotonic()
    try:
        tally = asyncio.run(scenario())
    except Exception as exc:  # a broken harness step must not hide the other rows
        tally = Tally(f"{item} (scenario raised)", failures=[f"{type(exc).__name__}: {str(exc)[:200]}"])
    found = leaks(probe(), base, settle_s)
    tally.leaked = leak_text(found)
    if found:
        tally.failures.append("leaked")
    echo(faultkit.table([tally]) + f"\n({time.monotonic() - started:.0f} s)")
    return tally


def run(items: set[str], n: int, log_dir: Path, echo: Callable[[str], None], bound_s: float = 90.0,
        settle_s: float = 20.0, max_queued: int = 16, kv_cache_memory: str = "12MiB") -> list[Tally]:
    """The fault rows of ``items`` (a subset of :data:`ITEMS`), on two ``faultkit.Cluster``s (1 prefill + 1 decode
    worker with a ``kv_cache_memory`` decode pool; the same for Redis, last) and one ``pdserve up``."""
    tallies: list[Tally] = []
    # bfloat16: these rows count answers, not compare texts, and bf16 runs 3-5x faster on CPU
    env = {"PDSERVE_DTYPE": "bfloat16", "PDSERVE_POD_TTL_S": "10"}
    # row 7: a grace long enough for its streams (the router's default, 30 s, spelled out: this row depends on it)
    small = {"decode-0": {"PDSERVE_KV_CACHE_MEMORY": kv_cache_memory}, "router": {"PDSERVE_SHUTDOWN_GRACE_S": "30"}}
    if items & {"1", "7", "9", "10", "11"}:
        with Cluster("--prefill", "1", "--decode", "1",
                     env=env, log_dir=log_dir / "faults", child_env=small) as cluster:
            echo(f"fault rows: ensemble up (logs in {cluster.log_dir})")
            probe = lambda: Probe.of(cluster)  # noqa: E731 - routers may be added or restarted
            rows: list[tuple[str, Callable[[], Awaitable[Tally]]]] = [
                ("1", lambda: kv_cache_full(cluster, 2 * n, bound_s=2 * bound_s)),
                ("10", lambda: silent_kv_port(cluster, n, bound_s=bound_s)),
                ("9", lambda: prefill_sigstop(cluster, n, bound_s=bound_s)),
                ("7", lambda: router_sigterm(cluster, n, bound_s=bound_s)),
            ]
            for item, scenario in rows:
                if item in items:
                    tallies.append(measured(probe, item, scenario, settle_s, echo))
            if "11" in items:
                router = cluster.extra_router({"PDSERVE_MAX_QUEUED_REQUESTS": str(max_queued)})
                url = router.health_url.removesuffix("/health")
                tallies.append(measured(probe, "11", lambda: prompt_list(url, max_queued, bound_s=bound_s / 1.5),
                                        settle_s, echo))
    if "6" in items:
        with Cluster("--prefill", "1", "--decode", "1", env=env, log_dir=log_dir / "redis-loss") as cluster:
            echo(f"fault rows: Redis-loss ensemble up (logs in {cluster.log_dir})")
            for how in ("flushall", "kill"):
                tallies.append(measured(lambda: Probe.of(cluster), "6",
                                        lambda: redis_data_loss(cluster, n, how, bound_s=bound_s / 1.5),
                                        settle_s, echo))
    if "8" in items:
        with Cluster(env=env, log_dir=log_dir / "up", process=True) as ens:  # up's own supervision
            echo(f"fault rows: pdserve up started (logs in {ens.log_dir})")
            # the output streams of the requests cut with the router have no reader left: they expire (TTL)
            tallies.append(measured(lambda: Probe.of(ens), "8", lambda: up_restarts(ens, n, bound_s=bound_s),
                                    max(settle_s, keys.OUTPUT_TTL_S + 10), echo))
    return tallies
