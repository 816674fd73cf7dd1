"""KubeScaler against a stand-in API server over real HTTP.

No Kubernetes API server can run on this machine, so ``fake_kube.FakeKubeServer`` speaks the endpoints the
planner uses (deployments/scale GET and merge-patch PATCH, pods list) with the API server's shapes and status
codes. What is checked is the adapter's side of the contract: the paths, the patch content type and body,
and how responses and errors are read.
"""

from __future__ import annotations

import json

import pytest

from fake_kube import FakePod
from pdserve.services.planner.kube import KubeError, KubeScaler

PREFILL = "demo-pdserve-prefill"
SELECTOR = "app.kubernetes.io/component=prefill,app.kubernetes.io/instance=demo"


def test_get_scale_reads_replicas_and_the_pod_selector(kube):
    state, api = kube
    scale = KubeScaler("llm", api).get_scale(PREFILL)
    assert (scale.spec_replicas, scale.status_replicas, scale.selector) == (2, 2, SELECTOR)
    assert state.requests[-1].method == "GET"
    assert state.requests[-1].path == f"/apis/apps/v1/namespaces/llm/deployments/{PREFILL}/scale"


def test_set_replicas_sends_a_merge_patch_of_spec_replicas_only(kube):
    state, api = kube
    stored = KubeScaler("llm", api).set_replicas(PREFILL, 5)
    assert stored == 5 and state.deployments[PREFILL].replicas == 5
    req = state.requests[-1]
    assert req.method == "PATCH" and req.path.startswith(f"/apis/apps/v1/namespaces/llm/deployments/{PREFILL}/scale")
    assert req.content_type == "application/merge-patch+json"
    assert req.body == {"spec": {"replicas": 5}}
    assert "fieldManager=pdserve-planner" in req.path
    # The next read sees what was written.
    assert KubeScaler("llm", api).get_scale(PREFILL).spec_replicas == 5


def test_unknown_deployment_is_a_clear_error_with_the_status(kube):
    state, api = kube
    state.scale_allowed = None
    with pytest.raises(KubeError, match="HTTP 404") as err:
        KubeScaler("llm", api).get_scale("nope")
    assert err.value.status == 404
    with pytest.raises(KubeError, match="HTTP 404"):
        KubeScaler("llm", api).set_replicas("nope", 1)


def test_a_forbidden_scale_is_a_403_kube_error(kube):
    _, api = kube
    with pytest.raises(KubeError, match="HTTP 403") as err:
        KubeScaler("llm", api).set_replicas("demo-pdserve-router", 3)
    assert err.value.status == 403


def test_the_stand_in_refuses_a_patch_that_is_not_a_merge_patch(kube):
    """The oracle can fail: a plain JSON PATCH (not a patch media type) is refused with 415, as the API server does."""
    import httpx

    state, api = kube
    url = f"{api.configuration.host}/apis/apps/v1/namespaces/llm/deployments/{PREFILL}/scale"
    resp = httpx.patch(url, json={"spec": {"replicas": 4}})
    assert resp.status_code == 415 and resp.json()["reason"] == "UnsupportedMediaType"
    assert state.deployments[PREFILL].replicas == 2


def test_negative_replicas_never_reach_the_api(kube):
    state, api = kube
    with pytest.raises(ValueError):
        KubeScaler("llm", api).set_replicas(PREFILL, -1)
    assert not [r for r in state.requests if r.method == "PATCH"]


def test_list_pods_by_selector_reports_phase_readiness_ip_and_deletion(kube):
    state, api = kube
    labels = {"app.kubernetes.io/component": "prefill", "app.kubernetes.io/instance": "demo"}
    state.pods = [
        FakePod("p-0", labels, "Running", True, "10.0.0.4"),
        FakePod("p-1", labels, "Pending", False, None),
        FakePod("p-2", labels, "Pending", False, None, deleting=True),
        FakePod("d-0", {"app.kubernetes.io/component": "decode", "app.kubernetes.io/instance": "demo"}),
    ]
    pods = {p.name: p for p in KubeScaler("llm", api).list_pods(SELECTOR)}
    assert set(pods) == {"p-0", "p-1", "p-2"}
    assert (pods["p-0"].phase, pods["p-0"].ready, pods["p-0"].ip, pods["p-0"].pending) == ("Running", True, "10.0.0.4", False)
    assert pods["p-1"].pending and not pods["p-1"].ready and pods["p-1"].ip is None
    assert not pods["p-2"].pending, "a Pending pod being deleted is not waiting for a node"
    path = state.requests[-1].path
    assert path.startswith("/api/v1/namespaces/llm/pods?") and "labelSelector=" in path


def test_unreachable_api_server_is_a_kube_error():
    from kubernetes import client as k8s

    from fake_kube import FakeKube, FakeKubeServer

    with FakeKubeServer(FakeKube()) as server:
        url = server.url
    with k8s.ApiClient(k8s.Configuration(host=url)) as api:
        with pytest.raises(KubeError) as err:
            KubeScaler("llm", api, timeout_s=2).get_scale(PREFILL)
    assert err.value.status == 0


def test_recorded_bodies_are_json(kube):
    state, api = kube
    KubeScaler("llm", api).set_replicas(PREFILL, 3)
    assert json.dumps(state.requests[-1].body) == '{"spec": {"replicas": 3}}'


LWS_NAME = "demo-pdserve-decode"
LEADERS = {"leaderworkerset.sigs.k8s.io/name": LWS_NAME, "leaderworkerset.sigs.k8s.io/worker-index": "0"}


def test_a_leaderworkerset_tier_is_read_and_scaled_through_its_scale_subresource(kube):
    from fake_kube import FakeDeployment

    state, api = kube
    del state.deployments[LWS_NAME]  # the multi-node decode tier is an LWS, not a Deployment
    state.lws[LWS_NAME] = FakeDeployment(2, LEADERS)
    scaler = KubeScaler("llm", api, kinds={LWS_NAME: "LeaderWorkerSet"})
    scale = scaler.get_scale(LWS_NAME)
    path = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/llm/leaderworkersets/{LWS_NAME}/scale"
    assert (scale.spec_replicas, scale.status_replicas) == (2, 2)
    # the leader pods only: one per replica, the pods that serve HTTP and export metrics
    assert scale.selector == "leaderworkerset.sigs.k8s.io/name=demo-pdserve-decode,leaderworkerset.sigs.k8s.io/worker-index=0"
    assert (state.requests[-1].method, state.requests[-1].path) == ("GET", path)
    assert scaler.set_replicas(LWS_NAME, 4) == 4 and state.lws[LWS_NAME].replicas == 4
    req = state.requests[-1]
    assert req.method == "PATCH" and req.path.startswith(path) and "fieldManager=pdserve-planner" in req.path
    assert (req.content_type, req.body) == ("application/merge-patch+json", {"spec": {"replicas": 4}})
    # the same name read as a Deployment is not there: the kind decides the API path
    with pytest.raises(KubeError, match="HTTP 404"):
        KubeScaler("llm", api).get_scale(LWS_NAME)
    # RBAC: an LWS whose scale the Role does not grant is a 403 like a Deployment's
    state.lws["other"] = FakeDeployment(1, LEADERS)
    with pytest.raises(KubeError, match="HTTP 403"):
        KubeScaler("llm", api, kinds={"other": "LeaderWorkerSet"}).set_replicas("other", 2)
    with pytest.raises(ValueError, match="workload kind must be one of"):
        KubeScaler("llm", api, kinds={LWS_NAME: "StatefulSet"})
