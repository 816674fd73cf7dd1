"""The planner's view of Kubernetes: a workload's scale subresource and its pods (``kubernetes`` client).

A tier is a Deployment, or a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``, the chart's multi-node mode: one
replica = one leader pod + its worker pods). Both expose the same ``autoscaling/v1`` Scale subresource; an LWS's
``status.selector`` there is its leader pods' (LWS's ``hpaPodSelector``), so replicas and pods count alike.
What it calls, and what the chart's Role grants (templates/planner.yaml):
  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}           spec.selector (the router's pods)
  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   spec.replicas, status.selector
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   {"spec": {"replicas": n}} as merge-patch
  GET   /apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{name}/scale    (the same two, for
  PATCH /apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{name}/scale     an LWS tier)
  GET   /api/v1/namespaces/{ns}/pods?labelSelector=...           phases, readiness, pod IPs
Patching the scale subresource (as ``kubectl scale`` and the HPA do) changes nothing else of the workload,
so the planner and ``helm upgrade`` never fight over the pod template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

MERGE_PATCH = "application/merge-patch+json"
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")  # group, version, plural of the LeaderWorkerSet CRD
KINDS = ("Deployment", "LeaderWorkerSet")
FIELD_MANAGER = "pdserve-planner"


class KubeError(RuntimeError):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0 when no response)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True, frozen=True)
class Scale:
    spec_replicas: int
    status_replicas: int
    selector: str  # label selector of the Deployment's pods, "k=v,k2=v2"


@dataclass(slots=True, frozen=True)
class PodInfo:
    name: str
    phase: str
    ready: bool
    ip: str | None
    deleting: bool

    @property
    def pending(self) -> bool:
        return self.phase == "Pending" and not self.deleting


def api_client_from_environment() -> k8s.ApiClient:
    """In a pod: the service account's token; elsewhere: ~/.kube/config (or $KUBECONFIG)."""
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        k8s_config.load_kube_config()
    return k8s.ApiClient()


class KubeScaler:
    """Scale subresource and pod listing for Deployments, and LeaderWorkerSets, in one namespace. ``kinds`` maps a
    workload name to ``"LeaderWorkerSet"`` where it is one (other names are Deployments)."""

    def __init__(self, namespace: str, api_client: k8s.ApiClient | None = None, timeout_s: float = 10.0,
                 kinds: dict[str, str] | None = None) -> None:
        self.namespace = namespace
        self._api = api_client or api_client_from_environment()
        self._apps = k8s.AppsV1Api(self._api)
        self._core = k8s.CoreV1Api(self._api)
        self._custom = k8s.CustomObjectsApi(self._api)
        self._timeout = timeout_s
        self.kinds = dict(kinds or {})
        unknown = {k for k in self.kinds.values() if k not in KINDS}
        if unknown:
            raise ValueError(f"workload kind must be one of {KINDS}, got {sorted(unknown)}")

    def _is_lws(self, name: str) -> bool:
        return self.kinds.get(name) == "LeaderWorkerSet"

    def _lws_scale(self, name: str, body: dict | None = None) -> Scale:
        """GET (or merge-PATCH with ``body``) a LeaderWorkerSet's scale subresource; its reply is a plain dict."""
        group, version, plural = LWS
        if body is None:
            s = self._call(f"get leaderworkersets/{name}/scale", self._custom.get_namespaced_custom_object_scale,
                           group, version, self.namespace, plural, name)
        else:
            s = self._call(f"patch leaderworkersets/{name}/scale", self._custom.patch_namespaced_custom_object_scale,
                           group, version, self.namespace, plural, name, body, field_manager=FIELD_MANAGER,
                           _content_type=MERGE_PATCH)
        spec, status = s.get("spec") or {}, s.get("status") or {}
        # before the LWS controller first reports, the leader pods' labels (LWS sets them on every pod it makes)
        selector = status.get("selector") or f"leaderworkerset.sigs.k8s.io/name={name},leaderworkerset.sigs.k8s.io/worker-index=0"
        return Scale(int(spec.get("replicas") or 0), int(status.get("replicas") or 0), selector)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, _request_timeout=self._timeout, **kwargs)
        except ApiException as exc:
            raise KubeError(f"{what}: HTTP {exc.status} {exc.reason}: {(exc.body or '')[:300]}", exc.status) from exc
        except Exception as exc:  # urllib3 connection errors and timeouts
            raise KubeError(f"{what}: {exc}") from exc

    def get_scale(self, deployment: str) -> Scale:
        if self._is_lws(deployment):
            return self._lws_scale(deployment)
        s = self._call(f"get deployments/{deployment}/scale", self._apps.read_namespaced_deployment_scale,
                       deployment, self.namespace)
        selector = (s.status.selector if s.status else None) or self._selector_from_deployment(deployment)
        return Scale(
            spec_replicas=int((s.spec.replicas if s.spec else None) or 0),
            status_replicas=int((s.status.replicas if s.status else None) or 0),
            selector=selector,
        )

    def deployment_selector(self, deployment: str) -> str:
        """The label selector of ``deployment``'s pods, from the Deployment itself (needs only ``get``
        on deployments, not on their scale)."""
        return self._selector_from_deployment(deployment)

    def _selector_from_deployment(self, deployment: str) -> str:
        d = self._call(f"get deployments/{deployment}", self._apps.read_namespaced_deployment, deployment, self.namespace)
        labels = d.spec.selector.match_labels or {}
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))

    def set_replicas(self, deployment: str, replicas: int) -> int:
        """Patch ``spec.replicas``; returns the count the API server stored."""
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        if self._is_lws(deployment):
            return self._lws_scale(deployment, {"spec": {"replicas": int(replicas)}}).spec_replicas
        s = self._call(f"patch deployments/{deployment}/scale", self._apps.patch_namespaced_deployment_scale,
                       deployment, self.namespace, {"spec": {"replicas": int(replicas)}}, field_manager=FIELD_MANAGER,
                       _content_type=MERGE_PATCH)
        return int(s.spec.replicas or 0)

    def list_pods(self, selector: str) -> list[PodInfo]:
        pods = self._call(f"list pods {selector!r}", self._core.list_namespaced_pod, self.namespace,
                          label_selector=selector)
        out = []
        for p in pods.items:
            conditions = (p.status.conditions if p.status else None) or []
            ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
            out.append(PodInfo(
                name=p.metadata.name,
                phase=(p.status.phase if p.status else None) or "Unknown",
                ready=ready,
                ip=p.status.pod_ip if p.status else None,
                deleting=p.metadata.deletion_timestamp is not None,
            ))
        return out
