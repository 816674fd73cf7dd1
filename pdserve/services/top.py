"""``pdserve top``: a live terminal view of a running ensemble (``pdserve up`` or a port-forwarded cluster).

It reads three things over HTTP, and nothing else:

- the registry's ``GET /v1/pods`` (with ``Authorization: Bearer <PDSERVE_REGISTRY_TOKEN>`` when one is given): the
  pods by tier, their load, KV blocks and last heartbeat;
- ``GET /metrics`` of the router and of every registered pod (its ``http_url``): queue depth, requests in flight
  by phase, and the TTFT/TPOT/ITL histograms. Percentiles are computed from the difference between two scrapes
  (Prometheus' ``histogram_quantile`` over a ``rate`` window), so they are rolling over the refresh interval;
  ``--once`` renders a single frame whose percentiles cover everything since the processes started;
- the router's ``GET /v1/pdserve/requests`` (``Authorization: Bearer <PDSERVE_API_KEY>`` when one is given): each
  choice in flight with its phase (queued, prefill, transfer, decode), age, tokens so far and pod.

A pod or router that cannot be scraped shows as ``unreachable``; a registry that cannot be read is an error line
in the frame (live mode keeps trying) or a non-zero exit (``--once``). No torch, no service imports: this module
only speaks the registry's and Prometheus' wire formats.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field

import click
import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pdserve.shared.protocol.registry import ROLES, TOKEN_ENV, PodInfo
from pdserve.shared.registry_client import RegistryClient, RegistryError

TTFT = "pdserve:time_to_first_token_seconds"
TPOT = "pdserve:time_per_output_token_seconds"
ITL = "pdserve:inter_token_latency_seconds"
QUANTILES = (0.5, 0.9, 0.99)


# ---- Prometheus text and histogram deltas ---------------------------------------------------------------------

@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram: cumulative counts by upper bound ``le`` (seconds, ``math.inf`` last), sorted."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, older: Histogram | None) -> Histogram:
        """Observations made since ``older`` (``None``: all of them). A histogram whose count went down was reset
        (the process restarted): then everything it holds is new, as Prometheus' ``rate`` treats a counter reset."""
        if older is None or older.count > self.count:
            return self
        before = dict(older.buckets)
        return Histogram(tuple((le, max(0.0, c - before.get(le, 0.0))) for le, c in self.buckets))

    def plus(self, other: Histogram) -> Histogram:
        """Bucket-wise sum (the same histogram of several pods); bounds missing on one side count as 0 there."""
        bounds = sorted({le for le, _ in self.buckets} | {le for le, _ in other.buckets})
        return Histogram(tuple((le, _cumulative_at(self, le) + _cumulative_at(other, le)) for le in bounds))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) in seconds, interpolated linearly inside its bucket as Prometheus'
        ``histogram_quantile`` does (the first bucket starts at 0; a quantile in the ``+Inf`` bucket is the last
        finite bound). ``None`` when the histogram holds no observation."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if math.isinf(le):
                    return lower
                return lower + (le - lower) * (rank - below) / (cumulative - below)
            lower, below = le, cumulative
        return lower


def _cumulative_at(h: Histogram, le: float) -> float:
    """Cumulative count of ``h`` at bound ``le`` (the largest of its bounds at or below ``le``)."""
    value = 0.0
    for bound, cumulative in h.buckets:
        if bound > le:
            break
        value = cumulative
    return value


@dataclass
class Scrape:
    """One ``/metrics`` page: gauges summed over their label sets, histograms summed over theirs."""

    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)


def parse_metrics(text: str) -> Scrape:
    """Parses Prometheus' text exposition format. Raises ``ValueError`` on text that is not that format."""
    scrape = Scrape()
    for family in text_string_to_metric_families(text):
        if family.type == "gauge":
            scrape.gauges[family.name] = sum(s.value for s in family.samples)
        elif family.type == "histogram":
            by_labels: dict[tuple, list[tuple[float, float]]] = {}
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    by_labels.setdefault(key, []).append((float(s.labels["le"]), s.value))
            total = Histogram(())
            for buckets in by_labels.values():
                total = total.plus(Histogram(tuple(sorted(buckets))))
            scrape.histograms[family.name] = total
    return scrape


# ---- one frame: registry + scrapes ---------------------------------------------------------------------------

@dataclass
class Frame:
    """What one refresh saw. ``pods``: the registry's alive pods; ``pod_metrics``/``router``: the parsed
    ``/metrics`` (``None``: unreachable); ``now``: unix seconds at the registry read (heartbeat ages)."""

    pods: list[PodInfo]
    pod_metrics: dict[str, Scrape | None]
    router: Scrape | None
    now: float
    registry_error: str | None = None
    # the router's GET /v1/pdserve/requests ``data`` (one dict per choice in flight); None: not read
    requests: list[dict] | None = None


async def _scrape(http: httpx.AsyncClient, url: str) -> Scrape | None:
    try:
        r = await http.get(url.rstrip("/") + "/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return None


async def _requests(http: httpx.AsyncClient, router_url: str | None, api_key: str | None) -> list[dict] | None:
    """The router's requests in flight (``GET /v1/pdserve/requests``), or None when it does not answer them."""
    if not router_url:
        return None
    try:
        r = await http.get(router_url.rstrip("/") + "/v1/pdserve/requests",
                           headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        r.raise_for_status()
        return list(r.json()["data"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def collect(registry: RegistryClient, http: httpx.AsyncClient, router_url: str | None,
                  api_key: str | None = None) -> Frame:
    """Reads the registry, then scrapes the router and every pod and reads the router's requests concurrently.
    ``api_key``: the router's API key (its request list is behind it when it has keys)."""
    error = None
    try:
        pods = await registry.list_pods()
    except RegistryError as e:
        pods, error = [], str(e)
    now = time.time()
    urls = [p.http_url for p in pods] + ([router_url] if router_url else [])
    *scraped, requests = await asyncio.gather(*(_scrape(http, u) for u in urls),
                                              _requests(http, router_url, api_key))
    return Frame(pods=pods, pod_metrics={p.pod_id: s for p, s in zip(pods, scraped)},
                 router=scraped[-1] if router_url else None, now=now, registry_error=error, requests=requests)


# ---- rendering -----------------------------------------------------------------------------------------------

def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _gauge(scrape: Scrape | None, name: str) -> float | None:
    return None if scrape is None else scrape.gauges.get(name)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def pods_table(frame: Frame) -> Table:
    """One row per pod, by tier then id: load (running / waiting / queued prompt tokens), KV blocks used of total
    and usage in percent (the registry's heartbeat), swapped requests (``/metrics``), heartbeat age."""
    table = Table(title="pods", title_justify="left")
    for name in ("tier", "pod", "url", "running", "waiting", "queued tok", "KV used/total", "KV %", "swapped",
                 "heartbeat age s", "metrics"):
        table.add_column(name, justify="left" if name in ("tier", "pod", "url", "metrics") else "right")
    for pod in sorted(frame.pods, key=lambda p: (ROLES.index(p.role), p.pod_id)):
        scrape = frame.pod_metrics.get(pod.pod_id)
        age = frame.now - pod.last_heartbeat if pod.last_heartbeat is not None else None
        tier = f"{pod.role} (colocated)" if pod.colocated else pod.role
        table.add_row(tier, pod.pod_id, pod.http_url, str(pod.num_running), str(pod.num_waiting),
                      str(pod.queued_prefill_tokens), f"{pod.total_blocks - pod.free_blocks}/{pod.total_blocks}",
                      f"{pod.kv_cache_usage * 100:.1f}", _count(_gauge(scrape, "pdserve:num_requests_swapped")),
                      "-" if age is None else f"{max(0.0, age):.1f}", "ok" if scrape is not None else "unreachable")
    return table


def phases_table(frame: Frame) -> Table:
    """Requests in flight by phase. Router: requests it is serving, entries in the prefill stream (XLEN).
    Pods (registry): prefill tier running/waiting; decode tier running (decoding) and waiting for the engine
    (arrived KV not yet in the batch); swapped (decode pods' ``/metrics``)."""
    table = Table(title="requests in flight", title_justify="left")
    for name in ("router serving", "prefill queue", "prefilling", "prefill waiting", "decoding", "decode waiting",
                 "swapped"):
        table.add_column(name, justify="right")
    tier = {role: [p for p in frame.pods if p.role == role] for role in ROLES}
    swapped = [_gauge(frame.pod_metrics.get(p.pod_id), "pdserve:num_requests_swapped") for p in tier["decode"]]
    table.add_row(_count(_gauge(frame.router, "pdserve:num_requests_running")),
                  _count(_gauge(frame.router, "pdserve:prefill_queue_depth")),
                  str(sum(p.num_running for p in tier["prefill"])), str(sum(p.num_waiting for p in tier["prefill"])),
                  str(sum(p.num_running for p in tier["decode"])), str(sum(p.num_waiting for p in tier["decode"])),
                  _count(sum(s for s in swapped if s is not None)) if any(s is not None for s in swapped) else "-")
    return table


REQUEST_COLUMNS = ("id", "choice", "phase", "age s", "prompt tok", "output tok", "prefill", "pod", "migrations")


def requests_table(frame: Frame, limit: int) -> Table:
    """One row per choice in flight, oldest first (the router's list, ``pdserve/services/router/inflight.py``): its
    phase (queued, prefill, transfer, decode), age, prompt and output tokens so far, where it is prefilled and the
    pod working on it now. At most ``limit`` rows; the title counts the rest and the phases."""
    listed = frame.requests or []
    counts = ", ".join(f"{sum(r['phase'] == p for r in listed)} {p}" for p in ("queued", "prefill", "transfer",
                                                                             "decode"))
    more = f", {len(listed) - limit} more not shown" if len(listed) > limit else ""
    title = "requests (router unreachable)" if frame.requests is None else f"requests: {counts}{more}"
    table = Table(title=title, title_justify="left")
    for name in REQUEST_COLUMNS:
        table.add_column(name, justify="right" if name.endswith(("tok", " s", "choice", "migrations")) else "left")
    for r in listed[:limit]:
        table.add_row(r["id"], str(r["index"]), r["phase"], f"{r['age_s']:.1f}", str(r["prompt_tokens"]),
                      str(r["output_tokens"]), r["prefill"], r["pod"], str(r["migrations"]))
    return table


def latency_rows(frame: Frame, previous: Frame | None) -> list[tuple[str, str, Histogram]]:
    """(source, metric, histogram of the window) for the router's TTFT/TPOT/ITL and each tier's TTFT/ITL
    (summed over its pods). The window is ``frame`` minus ``previous`` (``None``: since the processes started)."""
    def window(now: Scrape | None, then: Scrape | None, name: str) -> Histogram | None:
        if now is None or name not in now.histograms:
            return None
        return now.histograms[name].minus(then.histograms.get(name) if then is not None else None)

    rows = []
    for name, label in ((TTFT, "TTFT"), (TPOT, "TPOT"), (ITL, "ITL")):
        h = window(frame.router, previous.router if previous else None, name)
        if h is not None:
            rows.append(("router", label, h))
    for role in ROLES:
        for name, label in ((TTFT, "TTFT"), (ITL, "ITL")):
            total = None
            for pod in (p for p in frame.pods if p.role == role):
                then = previous.pod_metrics.get(pod.pod_id) if previous else None
                h = window(frame.pod_metrics.get(pod.pod_id), then, name)
                if h is not None:
                    total = h if total is None else total.plus(h)
            if total is not None:
                rows.append((f"{role} pods", label, total))
    return rows


def latency_table(frame: Frame, previous: Frame | None) -> Table:
    window = "since start" if previous is None else f"last {frame.now - previous.now:.1f} s"
    table = Table(title=f"latency ({window}), ms", title_justify="left")
    for name in ("source", "metric", "count", *(f"p{round(q * 100)}" for q in QUANTILES)):
        table.add_column(name, justify="left" if name in ("source", "metric") else "right")
    for source, metric, h in latency_rows(frame, previous):
        table.add_row(source, metric, f"{h.count:g}", *(_ms(h.quantile(q)) for q in QUANTILES))
    return table


def render(frame: Frame, previous: Frame | None, registry_url: str, router_url: str | None,
           max_requests: int = 20) -> Group:
    """The whole view of one refresh, as a rich renderable (at most ``max_requests`` request rows)."""
    tiers = ", ".join(f"{sum(p.role == r for p in frame.pods)} {r}" for r in ROLES)
    head = Text(f"pdserve top  registry {registry_url}  router {router_url or '-'}  pods: {tiers}  "
                f"{time.strftime('%H:%M:%S', time.localtime(frame.now))}")
    parts = [head]
    if frame.registry_error:
        parts.append(Text(f"registry: {frame.registry_error}", style="bold red"))
    if router_url and frame.router is None:
        parts.append(Text(f"router: {router_url}/metrics unreachable", style="bold red"))
    tables = [pods_table(frame), phases_table(frame)]
    if router_url:
        tables.append(requests_table(frame, max_requests))
    return Group(*parts, *tables, latency_table(frame, previous))


# ---- the command ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TopOptions:
    registry_url: str
    token: str | None
    router_url: str | None
    api_key: str | None
    interval: float
    once: bool
    max_requests: int


async def _run(o: TopOptions, console: Console) -> int:
    async with RegistryClient(o.registry_url, token=o.token, timeout_s=max(1.0, o.interval)) as registry, \
            httpx.AsyncClient(timeout=max(1.0, o.interval)) as http:
        frame = await collect(registry, http, o.router_url, o.api_key)
        if o.once:
            console.print(render(frame, None, o.registry_url, o.router_url, o.max_requests))
            return 1 if frame.registry_error else 0
        from rich.live import Live

        previous = None
        with Live(render(frame, None, o.registry_url, o.router_url, o.max_requests), console=console,
                  screen=False, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(o.interval)
                previous, frame = frame, await collect(registry, http, o.router_url, o.api_key)
                live.update(render(frame, previous, o.registry_url, o.router_url, o.max_requests), refresh=True)


@click.command("top")
@click.option("--router-url", default=lambda: os.environ.get("PDSERVE_ROUTER_URL", "http://127.0.0.1:8000"),
              show_default="$PDSERVE_ROUTER_URL or http://127.0.0.1:8000",
              help="The router, for its /metrics ('' to skip it).")
@click.option("--registry-url", default=lambda: os.environ.get("PDSERVE_REGISTRY_URL", "http://127.0.0.1:8001"),
              show_default="$PDSERVE_REGISTRY_URL or http://127.0.0.1:8001",
              help="The registry (pdserve up prints its URL).")
@click.option("--registry-token", envvar=TOKEN_ENV, default=None, show_envvar=True,
              help="The registry's bearer token (pdserve up generates one per run unless the variable is set).")
@click.option("--api-key", envvar="PDSERVE_API_KEY", default=None, show_envvar=True,
              help="The router's API key, for its request list when the router has keys.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between refreshes; latency percentiles cover the last interval.")
@click.option("--max-requests", type=click.IntRange(min=0), default=20, show_default=True,
              help="Rows of the per-request list (oldest first).")
@click.option("--once", is_flag=True, help="Render one frame to stdout and exit (percentiles since start).")
def command(router_url: str, registry_url: str, registry_token: str | None, api_key: str | None, interval: float,
            max_requests: int, once: bool) -> None:
    """A live view of a running ensemble: pods by tier, load, KV usage, heartbeat age, requests in flight by
    phase and one by one, rolling TTFT/TPOT. Exit status with --once: 1 when the registry could not be read."""
    console = Console(width=160) if once else Console()
    options = TopOptions(registry_url, registry_token or None, router_url or None, (api_key or "").split(",")[0]
                         or None, interval, once, max_requests)
    try:
        code = asyncio.run(_run(options, console))
    except KeyboardInterrupt:
        code = 0
    except ValueError as e:  # a token that cannot travel in a header (check_token)
        raise click.BadParameter(str(e), param_hint="--registry-token") from None
    raise SystemExit(code)
