"""One planning round: observe (Kubernetes, Redis, the pods' /metrics), decide per tier, apply, export."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from .backlog import read_backlog
from .decision import (
    HOLD,
    Decision,
    DecodeSignals,
    PrefillSignals,
    Recommendation,
    ThroughputEstimator,
    TierObservation,
    TierState,
    decide,
    not_applied,
    recommend_decode,
    recommend_prefill,
)
from .kube import KubeError, KubeScaler, PodInfo
from .metrics import PlannerMetrics
from .settings import PlannerSettings
from .signals import (
    KV_CACHE_USAGE,
    PREFILL_QUEUE_TOKENS,
    PROMPT_TOKENS_TOTAL,
    TPOT,
    TTFT,
    CounterDeltas,
    MetricsParseError,
    gauge_max,
    gauge_mean,
    mean_over_interval,
    parse_samples,
)

logger = logging.getLogger(__name__)

TIERS = ("prefill", "decode")


@dataclass(slots=True)
class TierView:
    """A tier as observed this round."""

    spec_replicas: int
    pods: list[PodInfo]
    samples: dict[str, dict[str, float]] = field(default_factory=dict)  # pod name -> parsed /metrics

    @property
    def pending(self) -> int:
        return sum(p.pending for p in self.pods)


class Planner:
    """Sizes the prefill and decode Deployments; call :meth:`run_once` every ``settings.interval_seconds``."""

    def __init__(
        self,
        settings: PlannerSettings,
        scaler: KubeScaler,
        redis_client: Any | None,
        http: httpx.Client | None = None,
        metrics: PlannerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.scaler = scaler
        self.redis = redis_client
        self.http = http or httpx.Client(timeout=settings.scrape_timeout_seconds)
        self.metrics = metrics or PlannerMetrics()
        self.clock = clock
        self.states = {tier: TierState() for tier in TIERS}
        self.throughput = ThroughputEstimator(settings.prefill_throughput_prior)
        self._deltas = CounterDeltas()
        self._prev: tuple[float, float] | None = None  # (time, backlog tokens) of the last round

    # --- observe ---

    def _deployment(self, tier: str) -> str:
        return getattr(self.settings, f"{tier}_deployment")

    def _view(self, deployment: str, port: int, scaled: bool = True) -> TierView:
        """Pods and metrics of ``deployment``; ``scaled`` also reads its scale (the planner's Role allows that
        only for the tiers it sizes)."""
        if scaled:
            scale = self.scaler.get_scale(deployment)
            replicas, selector = scale.spec_replicas, scale.selector
        else:
            replicas, selector = 0, self.scaler.deployment_selector(deployment)
        pods = self.scaler.list_pods(selector)
        view = TierView(replicas, pods)
        for pod in pods:
            if pod.phase != "Running" or not pod.ip or pod.deleting:
                continue
            host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
            try:
                resp = self.http.get(f"http://{host}:{port}/metrics")
                resp.raise_for_status()
                view.samples[pod.name] = parse_samples(resp.text)
            except (httpx.HTTPError, MetricsParseError) as exc:
                self.metrics.errors.labels("scrape").inc()
                logger.info("scrape of %s failed: %s", pod.name, exc)
        return view

    def _backlog_tokens(self, gauges: list[dict[str, float]]) -> float | None:
        if self.redis is not None:
            try:
                backlog = read_backlog(self.redis)
                self.metrics.backlog_entries.set(backlog.entries)
                return float(backlog.tokens)
            except Exception as exc:  # redis-py raises many types; the gauge below is the fallback
                self.metrics.errors.labels("redis").inc()
                logger.warning("reading the prefill queue from Redis failed: %s", exc)
        return gauge_max(gauges, PREFILL_QUEUE_TOKENS)

    # --- one round ---

    def run_once(self) -> list[Decision]:
        """Observe, decide and apply once; returns the decisions (tiers that could not be read are skipped)."""
        s = self.settings
        now = self.clock()
        self.metrics.rounds.inc()
        views: dict[str, TierView] = {}
        for tier, port in (("prefill", s.prefill_metrics_port), ("decode", s.decode_metrics_port)):
            try:
                views[tier] = self._view(self._deployment(tier), port)
            except KubeError as exc:
                self.metrics.errors.labels("kubernetes").inc()
                logger.warning("cannot read %s: %s", self._deployment(tier), exc)
        router = TierView(0, [])
        if s.router_deployment:
            try:
                router = self._view(s.router_deployment, s.router_metrics_port, scaled=False)
            except KubeError as exc:
                self.metrics.errors.labels("kubernetes").inc()
                logger.info("cannot read router %s: %s", s.router_deployment, exc)

        prefill_samples = views["prefill"].samples if "prefill" in views else {}
        decode_samples = views["decode"].samples if "decode" in views else {}
        backlog = self._backlog_tokens(list(router.samples.values()) + list(prefill_samples.values()))
        ttft = mean_over_interval(self._deltas, router.samples | prefill_samples, TTFT)
        tpot = mean_over_interval(self._deltas, router.samples | decode_samples, TPOT)
        processed, pods_seen = self._deltas.delta(prefill_samples, PROMPT_TOKENS_TOTAL)

        decisions = []
        if "prefill" in views:
            view = views["prefill"]
            if backlog is None:
                rec = Recommendation(view.spec_replicas, "no backlog signal (Redis and queue gauge unavailable)")
            else:
                rec = recommend_prefill(self._prefill_signals(now, backlog, processed, pods_seen, ttft),
                                        view.spec_replicas, s.ttft_slo_seconds)
            decisions.append(self._decide_and_apply("prefill", view, rec, now))
        if "decode" in views:
            view = views["decode"]
            kv = gauge_mean(decode_samples.values(), KV_CACHE_USAGE)
            self.metrics.kv_usage.set(kv if kv is not None else float("nan"))
            rec = recommend_decode(DecodeSignals(kv, tpot), view.spec_replicas, s.target_kv_cache_usage,
                                   s.tpot_slo_seconds, s.tolerance)
            decisions.append(self._decide_and_apply("decode", view, rec, now))
        self.metrics.ttft.set(ttft if ttft is not None else float("nan"))
        self.metrics.tpot.set(tpot if tpot is not None else float("nan"))
        return decisions

    def _prefill_signals(self, now: float, backlog: float, processed: float, pods_seen: int,
                         ttft: float | None) -> PrefillSignals:
        arrival = 0.0
        if self._prev is not None and now > self._prev[0]:
            dt = now - self._prev[0]
            rate = processed / dt
            saturated = backlog > 0 and self._prev[1] > 0
            if pods_seen:
                self.throughput.update(rate / pods_seen, saturated)
            # Tokens that came in = tokens processed + growth of the queue.
            arrival = max(0.0, rate + (backlog - self._prev[1]) / dt)
        self._prev = (now, backlog)
        self.metrics.backlog_tokens.set(backlog)
        self.metrics.arrival_tokens.set(arrival)
        self.metrics.prefill_throughput.set(self.throughput.estimate)
        return PrefillSignals(backlog, arrival, self.throughput.estimate, ttft)

    def _decide_and_apply(self, tier: str, view: TierView, rec: Recommendation, now: float) -> Decision:
        policy = self.settings.policy(tier)
        decision, state = decide(tier, policy, self.states[tier], TierObservation(view.spec_replicas, view.pending),
                                 rec, now)
        if decision.changes:
            if self.settings.dry_run:
                state = not_applied(state, view.spec_replicas)
                logger.info("%s: would scale %d -> %d (dry run): %s", tier, decision.current, decision.desired,
                            decision.reason)
            else:
                try:
                    self.scaler.set_replicas(self._deployment(tier), decision.desired)
                    logger.info("%s: scaled %d -> %d: %s", tier, decision.current, decision.desired, decision.reason)
                except KubeError as exc:
                    self.metrics.errors.labels("kubernetes").inc()
                    logger.warning("%s: scaling to %d failed: %s", tier, decision.desired, exc)
                    state = not_applied(state, view.spec_replicas)
        elif decision.action == HOLD:
            logger.debug("%s: hold at %d: %s", tier, decision.current, decision.reason)
        self.states[tier] = state
        self.metrics.record(decision, view.pending, state.backoff_until is not None and now < state.backoff_until)
        return decision
