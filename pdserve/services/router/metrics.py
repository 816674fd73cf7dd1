"""The router's Prometheus metrics (vLLM's names and buckets, ``pdserve:`` prefix), measured at the router.

TTFT here includes queueing and transfer: it is what the client sees. ITL is the gap between output events of
one choice; TPOT per request = (E2E - TTFT) / (completion_tokens - 1).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from pdserve.shared.metric_table import Metric, build

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]


_T, _I, _E = tuple(TTFT_BUCKETS), tuple(ITL_BUCKETS), tuple(E2E_BUCKETS)
# Every row but two carries the ``model_name`` label (the base label).
METRICS = (
    Metric("requests", "counter", "pdserve:router_requests", "HTTP requests by endpoint and status",
           ("endpoint", "status"), base=False),
    Metric("running", "gauge", "pdserve:num_requests_running", "Requests this router is serving now"),
    # 1 when the last /metrics scrape reached Redis, else 0 (the PdserveRedisUnreachable alert, docs/runbooks.md)
    Metric("redis_up", "gauge", "pdserve:redis_up", "1 if Redis answered at the last scrape, else 0", base=False),
    Metric("queue_depth", "gauge", "pdserve:prefill_queue_depth", "Entries in the prefill stream (XLEN)"),
    Metric("ttft", "histogram", "pdserve:time_to_first_token_seconds", "Time to first token seen by the router",
           buckets=_T),
    Metric("itl", "histogram", "pdserve:inter_token_latency_seconds", "Gap between output events of a choice",
           buckets=_I),
    Metric("tpot", "histogram", "pdserve:time_per_output_token_seconds", "Mean time per output token after the first",
           buckets=_I),
    Metric("e2e", "histogram", "pdserve:e2e_request_latency_seconds", "Request latency seen by the router",
           buckets=_E),
    # usage as clients got it: only the router counts these names (workers count compute under other names), so a
    # sum over every pod of the ensemble is the sum of the responses' usage (docs/metrics.md "Counters")
    Metric("prompt_tokens", "counter", "pdserve:prompt_tokens", "Prompt tokens of finished requests"),
    Metric("generation_tokens", "counter", "pdserve:generation_tokens", "Generated tokens of finished requests"),
    Metric("prompt_tokens_cached", "counter", "pdserve:prompt_tokens_cached", "Prompt tokens of finished requests "
           "served from a prefix cache (usage.prompt_tokens_details.cached_tokens)"),
    Metric("success", "counter", "pdserve:request_success", "Finished choices by finish reason", ("finished_reason",)),
    Metric("aborted", "counter", "pdserve:requests_aborted", "Requests aborted (client gone, timeout, error)",
           ("reason",)),
    # decision: local | remote; reason: the policy's filter or picker that decided (pd_policy.REASONS)
    Metric("pd_decisions", "counter", "pdserve:pd_decisions", "Prefill placement decisions (choices), by reason",
           ("decision", "reason")),
    Metric("migrations", "counter", "pdserve:request_migrations", "Choices moved off a dead decode pod", ("reason",)),
    # KV-aware routing: chosen pods, and the prompt blocks the chosen pod already held (expected hit rate)
    Metric("routing_decisions", "counter", "pdserve:routing_decisions", "Decode pods chosen, by routing mode",
           ("mode", "pod")),
    Metric("routing_prompt_blocks", "counter", "pdserve:routing_prompt_blocks", "Full prompt blocks of routed requests"),
    Metric("routing_cached_blocks", "counter", "pdserve:routing_cached_blocks",
           "Prompt blocks the chosen decode pod already held (registry lookup)"),
)
BASE_LABELS = ("model_name",)


class RouterMetrics:
    """The router's metrics (``METRICS``), each an attribute by its row's ``attr``. One registry per app, so
    several routers (tests) live in one process."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, resident memory, open fds
        PlatformCollector(registry=self.registry)
        self.model_name = model_name
        for attr, metric in build(METRICS, self.registry, {"model_name": model_name}).items():
            setattr(self, attr, metric)

    def observe_routing(self, mode: str, pod_id: str, num_blocks: int, cached_blocks: int) -> None:
        self.routing_decisions.labels(self.model_name, mode, pod_id).inc()
        self.routing_prompt_blocks.inc(num_blocks)
        self.routing_cached_blocks.inc(cached_blocks)


class ChoiceTiming:
    """Router-side TTFT / ITL / TPOT / E2E of one choice; ``arrival`` is ``time.monotonic()`` at the request."""

    __slots__ = ("arrival", "first", "last")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None

    def on_event(self, metrics: RouterMetrics, event: Any) -> None:
        """Observe one ``OutputEvent`` of the choice (its ``token_ids``, ``finished``, ``completion_tokens``)."""
        now = time.monotonic()
        if event.token_ids:
            if self.first is None:
                self.first = now
                metrics.ttft.observe(now - self.arrival)
            elif self.last is not None:
                metrics.itl.observe(now - self.last)
            self.last = now
        if event.finished:
            metrics.e2e.observe(now - self.arrival)
            if self.first is not None and event.completion_tokens > 1:
                metrics.tpot.observe((now - self.first) / (event.completion_tokens - 1))
