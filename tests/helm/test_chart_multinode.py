"""Chart: multi-node tensor parallelism renders a LeaderWorkerSet per tier.

Oracles: our JSON Schema of the LeaderWorkerSet CRD (lws_schema.py: written from the CRD's Go types, with the pod
templates checked against Kubernetes' own PodTemplateSpec schema); the real `pdserve tp-worker` command parsing
the worker pod's args (with the variables LWS sets) and the real WorkerSettings/EngineConfig reading the leader
pod's environment; the planner's settings object. The NetworkPolicies of this mode are checked with every other
mode's in test_network_policy.py (the "multinode" values file): rank-to-rank paths allowed, nothing more.
"""

from __future__ import annotations

import copy

import pytest

from chart_render import RELEASE, by_kind, load_values, render_docs
from lws_schema import validate_leaderworkerset
from test_service_settings import pod_environment

FULL = f"{RELEASE}-pdserve"


@pytest.fixture(scope="module")
def docs(chart):
    return render_docs(chart, load_values("multinode"))


def _lws(docs) -> dict:
    return by_kind(docs, "LeaderWorkerSet")[f"{FULL}-decode"]


def _container(template) -> dict:
    (c,) = template["spec"]["containers"]
    return c


def test_a_multi_node_tier_is_a_leaderworkerset_that_validates_against_the_crd(docs):
    assert f"{FULL}-decode" not in by_kind(docs, "Deployment")
    assert f"{FULL}-prefill" in by_kind(docs, "Deployment")  # prefill stays on one node (TP=4, 4 GPUs)
    lws = _lws(docs)
    for kube_version in ("1.29", "1.33"):
        assert validate_leaderworkerset(lws, kube_version) == []
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert (lwt["size"], lwt["restartPolicy"]) == (3, "RecreateGroupOnPodRestart")
    assert "replicas" not in lws["spec"]  # the planner owns the count (autoscaling.mode planner)
    leader, worker = _container(lwt["leaderTemplate"]), _container(lwt["workerTemplate"])
    # TP=12 over 3 pods: 4 ranks and 4 GPUs per pod
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert leader["args"] == ["decode"] and {"startupProbe", "readinessProbe", "livenessProbe"} <= leader.keys()
    # the worker pods serve nothing: no probes, no ports, no secrets, no Redis; only the leader is the tier
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & worker.keys()
    assert not [e for e in worker["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    labels = lwt["workerTemplate"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "decode-worker"
    service = by_kind(docs, "Service")[f"{FULL}-decode"]["spec"]["selector"]
    assert service.items() <= lwt["leaderTemplate"]["metadata"]["labels"].items()
    assert not service.items() <= labels.items()


def test_the_worker_pods_args_and_the_leaders_env_meet_at_one_rendezvous(docs, monkeypatch):
    from pdserve.services.tp_worker import command
    from pdserve.shared.worker.settings import WorkerSettings

    lwt = _lws(docs)["spec"]["leaderWorkerTemplate"]
    leader, worker = _container(lwt["leaderTemplate"]), _container(lwt["workerTemplate"])
    # what LWS puts in every container of group 0 (kubernetes-sigs/lws: LWS_LEADER_ADDRESS is the leader pod's
    # DNS name under the LWS's headless Service; LWS_WORKER_INDEX the pod's index in its group)
    lws_env = {"LWS_LEADER_ADDRESS": f"{FULL}-decode-0.{FULL}-decode.llm", "LWS_WORKER_INDEX": "2", "LWS_GROUP_SIZE": "3"}
    args = [a.replace("$(LWS_LEADER_ADDRESS)", lws_env["LWS_LEADER_ADDRESS"]).replace(
        "$(LWS_WORKER_INDEX)", lws_env["LWS_WORKER_INDEX"]) for a in worker["args"][1:]]
    assert worker["args"][0] == "tp-worker"
    ctx = command.make_context("tp-worker", args)
    assert (ctx.params["node_rank"], ctx.params["master_addr"]) == (2, f"{FULL}-decode-0.{FULL}-decode.llm")
    for k, v in pod_environment(docs, "decode").items():
        monkeypatch.setenv(k, v)
    config = WorkerSettings().engine_config()  # EngineConfig checks tensor_parallel_size % nnodes
    assert (config.tensor_parallel_size, config.nnodes) == (12, int(lws_env["LWS_GROUP_SIZE"]))
    rendezvous = {p["name"]: p["containerPort"] for p in leader["ports"]}["rendezvous"]
    assert config.master_port == ctx.params["master_port"] == rendezvous
    worker_env = {e["name"]: e["value"] for e in worker["env"] if "value" in e}
    assert float(worker_env["PDSERVE_TP_JOIN_TIMEOUT_S"]) == config.tp_join_timeout_s == 600


def test_the_lws_schema_refuses_what_the_crd_refuses(docs):
    """The oracle can fail: a misspelt field, a wrong enum, a size of 0, a bad pod template are each caught."""
    good = _lws(docs)
    for path, value, expected in [
        (("spec", "leaderWorkerTemplate", "sise"), 3, "Additional properties"),
        (("spec", "leaderWorkerTemplate", "restartPolicy"), "Always", "is not one of"),
        (("spec", "leaderWorkerTemplate", "size"), 0, "less than the minimum"),
        (("spec", "startupPolicy"), "Eager", "is not one of"),
        (("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "readinessprobe"), {}, "workerTemplate"),
    ]:
        bad = copy.deepcopy(good)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        errors = validate_leaderworkerset(bad)
        assert errors and expected in " ".join(errors), (path, errors)
    bad = copy.deepcopy(good)
    del bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert "'workerTemplate' is a required property" in " ".join(validate_leaderworkerset(bad))


def test_nodes_that_do_not_divide_the_ranks_are_refused(chart):
    with pytest.raises(Exception, match=r"decode.multiNode.nodes \(3\) must be at least 2 and divide "
                                        r"decode.tensorParallelSize \(8\)"):
        render_docs(chart, {"decode": {"tensorParallelSize": 8, "multiNode": {"enabled": True, "nodes": 3}}})


def test_the_planner_and_the_hpa_scale_the_leaderworkerset(chart, docs, monkeypatch):
    from pdserve.services.planner.settings import PlannerSettings

    (role,) = by_kind(docs, "Role").values()
    scales = {(tuple(r["apiGroups"]), tuple(r["resources"])): r["resourceNames"] for r in role["rules"]
              if any(res.endswith("/scale") for res in r["resources"])}
    assert scales == {(("apps",), ("deployments/scale",)): [f"{FULL}-prefill"],
                      (("leaderworkerset.x-k8s.io",), ("leaderworkersets/scale",)): [f"{FULL}-decode"]}
    for k, v in pod_environment(docs, "planner").items():
        monkeypatch.setenv(k, v)
    s = PlannerSettings()
    assert s.workload_kinds() == {f"{FULL}-prefill": "Deployment", f"{FULL}-decode": "LeaderWorkerSet"}
    hpa_docs = render_docs(chart, load_values("hpa") | {"decode": {"tensorParallelSize": 2, "multiNode": {"enabled": True}}})
    hpas = by_kind(hpa_docs, "HorizontalPodAutoscaler")
    assert hpas[f"{FULL}-decode"]["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": f"{FULL}-decode"}
    assert hpas[f"{FULL}-prefill"]["spec"]["scaleTargetRef"]["kind"] == "Deployment"
