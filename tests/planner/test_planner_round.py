"""Whole planning rounds: a real redis-server holding the prefill queue, real HTTP servers exporting the tiers'
Prometheus text, and the stand-in Kubernetes API (no API server can run here; see fake_kube.py)."""

from __future__ import annotations

import redis

from fake_kube import FakePod
from pdserve.services.planner.decision import HOLD, SCALE_UP
from pdserve.services.planner.kube import KubeScaler
from pdserve.services.planner.planner import Planner
from pdserve.services.planner.settings import PlannerSettings
from pdserve.shared.protocol.keys import PREFILL_GROUP, PREFILL_STREAM
from pdserve.shared.protocol.messages import PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams

PREFILL, DECODE = "demo-pdserve-prefill", "demo-pdserve-decode"
PREFILL_LABELS = {"app.kubernetes.io/component": "prefill", "app.kubernetes.io/instance": "demo"}
DECODE_LABELS = {"app.kubernetes.io/component": "decode", "app.kubernetes.io/instance": "demo"}
ROUTER_LABELS = {"app.kubernetes.io/component": "router", "app.kubernetes.io/instance": "demo"}


def decode_metrics(kv_usage: float, tpot_sum: float = 0.0, tpot_count: int = 0) -> str:
    return (
        "# HELP pdserve:kv_cache_usage_perc KV-cache usage\n# TYPE pdserve:kv_cache_usage_perc gauge\n"
        f"pdserve:kv_cache_usage_perc{{model_name=\"m\"}} {kv_usage}\n"
        "# HELP pdserve:time_per_output_token_seconds TPOT\n# TYPE pdserve:time_per_output_token_seconds histogram\n"
        f"pdserve:time_per_output_token_seconds_bucket{{le=\"+Inf\"}} {tpot_count}\n"
        f"pdserve:time_per_output_token_seconds_sum {tpot_sum}\n"
        f"pdserve:time_per_output_token_seconds_count {tpot_count}\n"
    )


def prefill_metrics(prompt_tokens_total: float) -> str:
    return ("# HELP pdserve:prompt_tokens_computed Prompt tokens\n# TYPE pdserve:prompt_tokens_computed counter\n"
            f"pdserve:prompt_tokens_computed_total {prompt_tokens_total}\n")


def enqueue(r: redis.Redis, n: int, tokens: int) -> None:
    for i in range(n):
        msg = PrefillRequest(request_id=f"r{i}-{r.xlen(PREFILL_STREAM) if r.exists(PREFILL_STREAM) else 0}",
                             model="m", prompt_token_ids=[1] * tokens, sampling_params=SamplingParams(),
                             decode_pod_id="d", decode_host="127.0.0.1", decode_kv_port=9000, arrival_time=0.0)
        r.xadd(PREFILL_STREAM, msg.encode())


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_planner(kube, redis_client, servers, **overrides):
    state, api = kube
    values = dict(
        namespace="llm", prefill_deployment=PREFILL, decode_deployment=DECODE, router_deployment="",
        prefill_metrics_port=servers["prefill"].port, decode_metrics_port=servers["decode"].port,
        router_metrics_port=servers["router"].port,
        ttft_slo_seconds=2.0, prefill_throughput_prior=1000, target_kv_cache_usage=0.75, tpot_slo_seconds=0.1,
        prefill_max_replicas=8, decode_max_replicas=8, scale_up_cooldown_seconds=0)
    settings = PlannerSettings(**(values | overrides))
    clock = Clock()
    return Planner(settings, KubeScaler("llm", api, kinds=settings.workload_kinds()), redis_client, clock=clock), clock


def test_a_round_sizes_both_tiers_from_redis_and_the_pods_metrics(kube, redis_server, metrics_servers):
    state, _ = kube
    state.pods = [FakePod("p-0", PREFILL_LABELS), FakePod("p-1", PREFILL_LABELS),
                  FakePod("d-0", DECODE_LABELS), FakePod("d-1", DECODE_LABELS)]
    r = redis.Redis.from_url(redis_server.url)
    r.xgroup_create(PREFILL_STREAM, PREFILL_GROUP, id="0", mkstream=True)
    enqueue(r, 10, 1000)
    r.xreadgroup(PREFILL_GROUP, "w", {PREFILL_STREAM: ">"}, count=3)  # 3 in prefill, 7 waiting
    metrics_servers["prefill"].text = prefill_metrics(0)
    metrics_servers["decode"].text = decode_metrics(0.9)
    planner, _ = make_planner(kube, r, metrics_servers)

    decisions = {d.tier: d for d in planner.run_once()}

    # prefill: 10 000 tokens / 2 s / 1000 tok/s per replica (the prior) = 5 replicas.
    assert (decisions["prefill"].action, decisions["prefill"].desired) == (SCALE_UP, 5)
    # decode: ceil(2 * 0.9 / 0.75) = 3.
    assert (decisions["decode"].action, decisions["decode"].desired) == (SCALE_UP, 3)
    assert (state.deployments[PREFILL].replicas, state.deployments[DECODE].replicas) == (5, 3)
    text = planner.metrics.render().decode()
    assert 'pdserve:planner_desired_replicas{tier="prefill"} 5.0' in text
    assert "pdserve:planner_backlog_tokens 10000.0" in text
    assert 'pdserve:planner_decisions_total{action="scale_up",tier="decode"} 1.0' in text


def test_measured_throughput_replaces_the_prior(kube, redis_server, metrics_servers):
    state, _ = kube
    state.pods = [FakePod("p-0", PREFILL_LABELS), FakePod("d-0", DECODE_LABELS)]
    state.deployments[PREFILL].replicas = 1
    r = redis.Redis.from_url(redis_server.url)
    r.xgroup_create(PREFILL_STREAM, PREFILL_GROUP, id="0", mkstream=True)
    enqueue(r, 8, 1000)
    metrics_servers["prefill"].text = prefill_metrics(50_000)
    metrics_servers["decode"].text = decode_metrics(0.75)
    planner, clock = make_planner(kube, r, metrics_servers, prefill_max_replicas=20)
    planner.run_once()
    # 10 s later the one pod has prefilled 40 000 more tokens (4000 tok/s) while the queue stayed at 8000.
    clock.t += 10
    metrics_servers["prefill"].text = prefill_metrics(90_000)
    state.deployments[PREFILL].replicas = planner.states["prefill"].last_applied
    d = {d.tier: d for d in planner.run_once()}["prefill"]
    assert planner.throughput.estimate == 4000
    # arrival 4000 tok/s (processed, queue flat) + 8000 tok / 2 s = 8000 tok/s -> 2 replicas of 4000.
    assert d.recommended == 2


def test_pending_pods_hold_a_scale_up(kube, redis_server, metrics_servers):
    state, _ = kube
    state.pods = [FakePod("p-0", PREFILL_LABELS), FakePod("p-1", PREFILL_LABELS, "Pending", False, None),
                  FakePod("d-0", DECODE_LABELS)]
    r = redis.Redis.from_url(redis_server.url)
    r.xgroup_create(PREFILL_STREAM, PREFILL_GROUP, id="0", mkstream=True)
    enqueue(r, 20, 1000)
    metrics_servers["prefill"].text = prefill_metrics(0)
    metrics_servers["decode"].text = decode_metrics(0.75)
    planner, _ = make_planner(kube, r, metrics_servers)
    d = {d.tier: d for d in planner.run_once()}["prefill"]
    assert d.action == HOLD and "Pending" in d.reason
    assert state.deployments[PREFILL].replicas == 2
    assert not [q for q in state.requests if q.method == "PATCH" and PREFILL in q.path]


def test_a_hand_set_count_is_left_alone(kube, redis_server, metrics_servers):
    state, _ = kube
    state.pods = [FakePod("p-0", PREFILL_LABELS), FakePod("d-0", DECODE_LABELS)]
    r = redis.Redis.from_url(redis_server.url)
    metrics_servers["prefill"].text = prefill_metrics(0)
    metrics_servers["decode"].text = decode_metrics(0.75)
    planner, clock = make_planner(kube, r, metrics_servers)
    planner.run_once()  # adopts 2 / 2
    state.deployments[DECODE].replicas = 6  # kubectl scale --replicas=6
    clock.t += 15
    d = {d.tier: d for d in planner.run_once()}["decode"]
    assert d.action == HOLD and "by hand" in d.reason
    assert state.deployments[DECODE].replicas == 6
    assert 'pdserve:planner_manual_override_backoff{tier="decode"} 1.0' in planner.metrics.render().decode()


def test_dry_run_decides_but_never_patches(kube, redis_server, metrics_servers):
    state, _ = kube
    state.pods = [FakePod("d-0", DECODE_LABELS)]
    metrics_servers["decode"].text = decode_metrics(1.0)
    planner, clock = make_planner(kube, redis.Redis.from_url(redis_server.url), metrics_servers, dry_run=True)
    d = {d.tier: d for d in planner.run_once()}["decode"]
    assert d.action == SCALE_UP and d.desired == 3
    clock.t += 15
    d = {d.tier: d for d in planner.run_once()}["decode"]
    assert d.action == SCALE_UP, "its own dry run is not mistaken for a manual change"
    assert not [q for q in state.requests if q.method == "PATCH"]


def test_without_redis_the_queue_gauge_is_the_backlog(kube, metrics_servers):
    state, _ = kube
    state.pods = [FakePod("p-0", PREFILL_LABELS), FakePod("d-0", DECODE_LABELS)]
    metrics_servers["prefill"].text = prefill_metrics(0) + (
        "# HELP pdserve:prefill_queue_tokens q\n# TYPE pdserve:prefill_queue_tokens gauge\n"
        "pdserve:prefill_queue_tokens 6000\n")
    metrics_servers["decode"].text = decode_metrics(0.75)
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    planner, _ = make_planner(kube, dead, metrics_servers)
    d = {d.tier: d for d in planner.run_once()}["prefill"]
    assert d.desired == 3  # 6000 / 2 s / 1000
    assert 'pdserve:planner_errors_total{stage="redis"} 1.0' in planner.metrics.render().decode()


def test_an_unreachable_pod_or_bad_metrics_does_not_stop_the_round(kube, redis_server, metrics_servers):
    state, _ = kube
    state.pods = [FakePod("d-0", DECODE_LABELS), FakePod("d-1", DECODE_LABELS, ip="127.0.0.2")]
    metrics_servers["decode"].text = "this is { not prometheus"
    planner, _ = make_planner(kube, redis.Redis.from_url(redis_server.url), metrics_servers)
    d = {d.tier: d for d in planner.run_once()}["decode"]
    assert d.action == HOLD and d.reason == "no decode metrics"
    assert 'pdserve:planner_errors_total{stage="scrape"} 2.0' in planner.metrics.render().decode()


def router_metrics(ttft_sum: float, ttft_count: int, tpot_sum: float, tpot_count: int) -> str:
    out = []
    for name, total, count in (("time_to_first_token_seconds", ttft_sum, ttft_count),
                               ("time_per_output_token_seconds", tpot_sum, tpot_count)):
        out += [f"# HELP pdserve:{name} x", f"# TYPE pdserve:{name} histogram",
                f'pdserve:{name}_bucket{{le="+Inf"}} {count}', f"pdserve:{name}_sum {total}",
                f"pdserve:{name}_count {count}"]
    return "\n".join(out) + "\n"


def test_ttft_and_tpot_come_from_the_router_pods_within_the_planners_rbac(kube, redis_server, metrics_servers):
    """The router is only read (Deployment + pods), never its scale: the Role does not grant that."""
    state, _ = kube
    state.pods = [FakePod("p-0", PREFILL_LABELS), FakePod("d-0", DECODE_LABELS), FakePod("r-0", ROUTER_LABELS)]
    r = redis.Redis.from_url(redis_server.url)
    r.xgroup_create(PREFILL_STREAM, PREFILL_GROUP, id="0", mkstream=True)
    enqueue(r, 1, 100)
    metrics_servers["prefill"].text = prefill_metrics(0)
    metrics_servers["decode"].text = decode_metrics(0.5)
    metrics_servers["router"].text = router_metrics(0, 0, 0, 0)
    planner, clock = make_planner(kube, r, metrics_servers, router_deployment="demo-pdserve-router", prefill_min_replicas=2,
                                  decode_scale_down_stabilization_seconds=0, scale_down_cooldown_seconds=0)
    planner.run_once()
    # Over the next 15 s: 10 requests, TTFT 3 s each (SLO 2 s) with a backlog; TPOT 0.2 s (SLO 0.1 s).
    clock.t += 15
    metrics_servers["router"].text = router_metrics(30.0, 10, 2.0, 10)
    decisions = {d.tier: d for d in planner.run_once()}
    assert "TTFT 3s over SLO" in decisions["prefill"].reason and decisions["prefill"].recommended == 3
    # TPOT 2x over its SLO outweighs KV usage 0.5 / 0.75: ceil(2 * 2.0) = 4.
    assert decisions["decode"].recommended == 4 and "TPOT" in decisions["decode"].reason
    assert 'pdserve:planner_errors_total{stage="kubernetes"}' not in planner.metrics.render().decode()
    assert not [q for q in state.requests if "demo-pdserve-router/scale" in q.path]


def test_a_multi_node_decode_tier_scales_its_leaderworkerset_replicas(kube, redis_server, metrics_servers):
    from fake_kube import FakeDeployment

    state, _ = kube
    del state.deployments[DECODE]
    leaders = {"leaderworkerset.sigs.k8s.io/name": DECODE, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    state.lws[DECODE] = FakeDeployment(2, leaders)
    workers = {"leaderworkerset.sigs.k8s.io/name": DECODE, "leaderworkerset.sigs.k8s.io/worker-index": "1"}
    # two groups (leader + one worker pod each); one more worker pod still Pending must not hold the scale-up:
    # only leader pods stand for replicas
    state.pods = [FakePod("p-0", PREFILL_LABELS), FakePod("d-0", leaders), FakePod("d-1", leaders),
                  FakePod("d-0-1", workers), FakePod("d-1-1", workers, "Pending", False, None)]
    r = redis.Redis.from_url(redis_server.url)
    metrics_servers["prefill"].text = prefill_metrics(0)
    metrics_servers["decode"].text = decode_metrics(0.9)
    planner, _ = make_planner(kube, r, metrics_servers, decode_workload_kind="LeaderWorkerSet")
    decisions = {d.tier: d for d in planner.run_once()}
    # decode: ceil(2 leaders * 0.9 / 0.75) = 3 groups
    assert (decisions["decode"].action, decisions["decode"].desired) == (SCALE_UP, 3)
    assert state.lws[DECODE].replicas == 3
    assert any(q.method == "PATCH" and "/leaderworkersets/" in q.path for q in state.requests)
