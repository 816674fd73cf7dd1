"""The result of one run: the JSON document (keys a superset of vLLM's), the printed table, per-request files."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pdserve.loadtest.metrics import compute_metrics, percentile_key
from pdserve.loadtest.runner import RunOutcome, loop_lag_summary
from pdserve.loadtest.timeline import RequestRecord

TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def rate_value(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def client_overhead(result: dict[str, Any], mock: dict[str, Any]) -> dict[str, float]:
    """Measured minus configured latencies against ``pdserve bench mock-server``: the client's own cost."""
    itl_cfg = 1000.0 * mock.get("tokens_per_chunk", 1) / mock["token_rate"] if mock.get("token_rate") else 0.0
    out = {"configured_ttft_ms": float(mock.get("ttft_ms", 0.0)), "configured_itl_ms": itl_cfg}
    for name, cfg in (("ttft", out["configured_ttft_ms"]), ("itl", itl_cfg)):
        if f"mean_{name}_ms" in result:
            out[f"mean_{name}_overhead_ms"] = result[f"mean_{name}_ms"] - cfg
        for key in [k for k in result if k.startswith("p") and k.endswith(f"_{name}_ms")]:
            out[key.replace(f"_{name}_ms", f"_{name}_overhead_ms")] = result[key] - cfg
    return out


def build_result(
    outcome: RunOutcome,
    *,
    meta: dict[str, Any],
    percentile_metrics: Sequence[str],
    percentiles: Sequence[float],
    goodput_slos_ms: dict[str, float] | None,
    lag_warning_ms: float,
    mock_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``meta`` (model, rate, dataset, ...) followed by the metrics, client health and per-label breakdown."""
    result: dict[str, Any] = {"date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"), **meta}
    result.update(compute_metrics(outcome.records, outcome.duration_s, percentile_metrics=percentile_metrics,
                                  percentiles=percentiles, goodput_slos_ms=goodput_slos_ms))
    result.update(loop_lag_summary(outcome.loop_lag_ms))
    result["client_cpu_seconds"] = outcome.client_cpu_s
    result["client_cpu_util"] = outcome.client_cpu_s / outcome.duration_s
    result["intended_send_times"] = [r.intended_send for r in outcome.records]
    result["actual_send_times"] = [r.actual_send for r in outcome.records]
    warning = None
    # at an infinite rate every request is "due" at t=0, so lag only measures how fast tasks start
    if meta.get("request_rate") != "inf" and result["p99_send_lag_ms"] > lag_warning_ms:
        warning = (f"client lag: p99 {result['p99_send_lag_ms']:.1f} ms (max {result['max_send_lag_ms']:.1f} ms) "
                   f"behind the intended send times: the load generator or its machine is too busy, so the offered "
                   f"load was lower and burstier than asked")
    result["client_lag_warning"] = warning
    labels = sorted({r.label for r in outcome.records if r.label})
    if len(labels) > 1:
        result["by_label"] = {}
        for label in labels:
            sub = [r for r in outcome.records if r.label == label]
            m = compute_metrics(sub, outcome.duration_s, percentile_metrics=percentile_metrics,
                                percentiles=sorted(set(percentiles) | {50.0, 99.0}), goodput_slos_ms=goodput_slos_ms)
            result["by_label"][label] = {k: v for k, v in m.items() if not isinstance(v, list)}
    if mock_config:
        result["mock_server"] = mock_config
        result["client_overhead"] = client_overhead(result, mock_config)
    return result


def format_table(result: dict[str, Any], percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """vLLM's result table, with pdserve's failure and client-lag lines."""
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(name: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        lines.append("{:<40} ".format(name) + (fmt.format(value) if value is not None else "n/a"))

    row("Successful requests:", result["completed"], "{:<10}")
    row("Failed requests:", result["failed"], "{:<10}")
    if result["failed_by_status"]:
        lines.append("  by status: " + ", ".join(f"{k}: {v}" for k, v in sorted(result["failed_by_status"].items())))
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"], "{:<10}")
    row("Request rate configured (RPS):", result.get("request_rate"), "{:<10}")
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", result["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
        row("SLO attainment (%):", 100.0 * result["slo_attainment"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"], "{:<10}")
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for name in percentile_metrics:
        title, short = TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            key = percentile_key(p)
            row(f"P{key[1:]} {short} (ms):", result[f"{key}_{name}_ms"])
    # beside TTFT/E2EL, which start at the send: the client's own --max-concurrency queue and the latencies a user
    # waiting in it sees
    lines.append("{s:{c}^{n}}".format(s="Client Queue (--max-concurrency)", n=w, c="-"))
    for name, short in (("queue_wait", "queue wait"), ("ttft_incl_queue", "TTFT incl. queue"),
                        ("e2el_incl_queue", "E2EL incl. queue")):
        row(f"Mean {short} (ms):", result.get(f"mean_{name}_ms"))
        row(f"P99 {short} (ms):", result.get(f"p99_{name}_ms"))
    lines.append("{s:{c}^{n}}".format(s="Client", n=w, c="-"))
    row("P99 send lag (ms):", result["p99_send_lag_ms"])
    row("P99 event-loop lag (ms):", result["p99_client_loop_lag_ms"])
    row("Client CPU (% of one core):", 100.0 * result["client_cpu_util"])
    if "client_overhead" in result:
        ov = result["client_overhead"]
        row("Mean TTFT overhead vs mock (ms):", ov.get("mean_ttft_overhead_ms"))
        row("Mean ITL overhead vs mock (ms):", ov.get("mean_itl_overhead_ms"))
    lines.append("=" * w)
    if result.get("client_lag_warning"):
        lines.append("WARNING: " + result["client_lag_warning"])
    return "\n".join(lines)


def record_row(rec: RequestRecord, tpot: float | None, n: int) -> dict[str, Any]:
    return {
        "index": rec.index, "label": rec.label, "session_id": rec.session_id, "turn": rec.turn,
        "success": rec.success, "status": rec.status, "error": rec.error,
        "prompt_len": rec.prompt_len, "usage_prompt_tokens": rec.usage_prompt_tokens,
        "expected_output_len": rec.expected_output_len, "output_len": n,
        "intended_send_s": rec.intended_send, "dispatch_s": rec.dispatch, "actual_send_s": rec.actual_send,
        "send_lag_ms": rec.send_lag * 1000.0, "queue_wait_ms": rec.queue_wait * 1000.0,
        "ttft_ms": rec.ttft * 1000.0 if rec.success else None,
        "tpot_ms": tpot * 1000.0 if tpot is not None else None,
        "e2el_ms": rec.latency * 1000.0 if rec.success else None,
        "num_chunks": len(rec.chunk_tokens),
        "itl_ms": [x * 1000.0 for x in rec.itl], "chunk_tokens": rec.chunk_tokens,
    }


def save_detailed(records: Sequence[RequestRecord], json_path: Path) -> tuple[Path, Path]:
    """Per-request JSONL and CSV beside ``json_path`` (``out.json`` -> ``out.requests.jsonl/.csv``)."""
    from pdserve.loadtest.metrics import output_len, request_tpot

    rows = []
    for rec in records:
        n = output_len(rec) if rec.success else 0
        rows.append(record_row(rec, request_tpot(rec, n) if rec.success else None, n))
    stem = json_path.with_suffix("")
    jsonl, csv_path = Path(f"{stem}.requests.jsonl"), Path(f"{stem}.requests.csv")
    with jsonl.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["index"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (";".join(f"{x:.3f}" if isinstance(x, float) else str(x) for x in v)
                                 if isinstance(v, list) else v) for k, v in row.items()})
    return jsonl, csv_path


def save_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
