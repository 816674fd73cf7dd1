"""PNG plots with matplotlib (Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.loadtest.metrics import output_len, request_tpot
from pdserve.loadtest.timeline import RequestRecord


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: Sequence[float], title: str) -> None:
    vals = sorted(values_ms)
    if vals:
        ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))])
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)


def plot_run(records: Sequence[RequestRecord], result: dict[str, Any], path: Path) -> None:
    """TTFT, TPOT and ITL distributions and TTFT against send time for one run."""
    plt = _plt()
    ok = [r for r in records if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], [r.ttft * 1e3 for r in ok], "TTFT (CDF)")
    tpots = [t * 1e3 for r in ok if (t := request_tpot(r, output_len(r))) is not None]
    _cdf(axes[0][1], tpots, "TPOT (CDF)")
    itls = [x * 1e3 for r in ok for x in r.itl]
    axes[1][0].hist(itls or [0.0], bins=50)
    axes[1][0].set_title("ITL per chunk")
    axes[1][0].set_xlabel("ms")
    axes[1][1].scatter([r.actual_send for r in ok], [r.ttft * 1e3 for r in ok], s=4)
    axes[1][1].set_title("TTFT against send time")
    axes[1][1].set_xlabel("s since start")
    axes[1][1].set_ylabel("TTFT ms")
    fig.suptitle(f"{result.get('model_id')} @ {result.get('request_rate')} req/s: "
                 f"{result['request_throughput']:.2f} req/s, {result['output_throughput']:.0f} tok/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(points: Sequence[dict[str, Any]], slos_ms: dict[str, float], path: Path,
               capacity: float | None = None) -> None:
    """TTFT and TPOT percentiles and throughput against the offered request rate."""
    plt = _plt()
    points = [p for p in points if p["offered_rate"] != float("inf")]
    rates = [p["offered_rate"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, metric in ((axes[0], "ttft"), (axes[1], "tpot")):
        for stat in ("median", "p90", "p99"):
            key = f"{stat}_{metric}_ms"
            if all(key in p for p in points):
                ax.plot(rates, [p[key] for p in points], marker="o", label=stat)
        if metric in slos_ms:
            ax.axhline(slos_ms[metric], color="red", linestyle="--", label=f"SLO {slos_ms[metric]:g} ms")
        ax.set_title(metric.upper())
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    ax.plot(rates, [p["request_throughput"] for p in points], marker="o", label="request throughput")
    if any(p.get("request_goodput") is not None for p in points):
        ax.plot(rates, [p.get("request_goodput") or 0 for p in points], marker="o", label="goodput")
    ax.plot(rates, rates, color="grey", linestyle=":", label="offered")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    ax2 = ax.twinx()
    ax2.plot(rates, [p["output_throughput"] for p in points], color="green", marker="s", label="output tok/s")
    ax2.set_ylabel("output tok/s")
    if capacity:
        ax.axvline(capacity, color="red", linestyle="--", label=f"SLO capacity {capacity:g}")
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
