"""The router's Prometheus metrics (vLLM's names and buckets, ``pdserve:`` prefix), measured at the router.

TTFT here includes queueing and transfer: it is what the client sees. ITL is the gap between output events of
one choice; TPOT per request = (E2E - TTFT) / (completion_tokens - 1).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               PlatformCollector, ProcessCollector)

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]


class RouterMetrics:
    """One registry per app, so several routers (tests) live in one process."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, resident memory, open fds
        PlatformCollector(registry=self.registry)
        r, m = self.registry, ["model_name"]
        self.model_name = model_name
        self.requests = Counter("pdserve:router_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge("pdserve:num_requests_running", "Requests this router is serving now",
                             m, registry=r).labels(model_name)
        # 1 when the last /metrics scrape reached Redis, else 0 (the PdserveRedisUnreachable alert, docs/runbooks.md)
        self.redis_up = Gauge("pdserve:redis_up", "1 if Redis answered at the last scrape, else 0", registry=r)
        self.queue_depth = Gauge("pdserve:prefill_queue_depth", "Entries in the prefill stream (XLEN)",
                                 m, registry=r).labels(model_name)
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token seen by the router",
                              m, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Gap between output events of a choice",
                             m, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("pdserve:time_per_output_token_seconds", "Mean time per output token after the first",
                              m, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Request latency seen by the router",
                             m, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of finished requests",
                                     m, registry=r).labels(model_name)
        # usage as clients got it: only the router counts these names (workers count compute under other names),
        # so a sum over every pod of the ensemble is the sum of the responses' usage (docs/metrics.md "Counters")
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens of finished requests",
                                         m, registry=r).labels(model_name)
        self.prompt_tokens_cached = Counter("pdserve:prompt_tokens_cached",
                                            "Prompt tokens of finished requests served from a prefix cache "
                                            "(usage.prompt_tokens_details.cached_tokens)", m, registry=r).labels(model_name)
        self.success = Counter("pdserve:request_success", "Finished choices by finish reason",
                               m + ["finished_reason"], registry=r)
        self.aborted = Counter("pdserve:requests_aborted", "Requests aborted (client gone, timeout, error)",
                               m + ["reason"], registry=r)
        # decision: local | remote; reason: the policy's filter or picker that decided (pd_policy.REASONS)
        self.pd_decisions = Counter("pdserve:pd_decisions", "Prefill placement decisions (choices), by reason",
                                    m + ["decision", "reason"], registry=r)
        self.migrations = Counter("pdserve:request_migrations", "Choices moved off a dead decode pod",
                                  m + ["reason"], registry=r)
        # KV-aware routing: chosen pods, and the prompt blocks the chosen pod already held (expected hit rate)
        self.routing_decisions = Counter("pdserve:routing_decisions", "Decode pods chosen, by routing mode",
                                         m + ["mode", "pod"], registry=r)
        self.routing_prompt_blocks = Counter("pdserve:routing_prompt_blocks", "Full prompt blocks of routed requests",
                                             m, registry=r).labels(model_name)
        self.routing_cached_blocks = Counter("pdserve:routing_cached_blocks",
                                             "Prompt blocks the chosen decode pod already held (registry lookup)",
                                             m, registry=r).labels(model_name)

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
