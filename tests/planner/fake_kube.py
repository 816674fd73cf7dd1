"""A stand-in for the Kubernetes API server, over real HTTP on 127.0.0.1.

No API server can run on this machine (no etcd, no kube-apiserver binary, no network to fetch one), so the
planner's adapter is tested against this small server instead. It speaks the three endpoints the planner uses,
with the API server's shapes and rules as documented in the Kubernetes API reference:

  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}        (apps/v1 Deployment, spec.selector)
  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale  (autoscaling/v1 Scale, status.selector)
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale  merge-patch / strategic-merge-patch only
                                                                 (415 otherwise), 422 on negative replicas
  GET   /api/v1/namespaces/{ns}/pods?labelSelector=k=v,k2=v2    (v1 PodList, equality selectors)
  GET/PATCH /apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{name}/scale
        the LeaderWorkerSet CRD's scale subresource, with the same rules; its Scale's status.selector is the
        leader pods' selector (the CRD's labelSelectorPath is .status.hpaPodSelector, which the LWS controller
        sets to its name and worker index 0: kubernetes-sigs/lws, api/leaderworkerset/v1 and its controller)

Unknown objects get 404 with a v1 Status body; a scale subresource outside ``scale_allowed`` gets 403, as the
chart's Role (resourceNames: the prefill and decode Deployments) would. Every request is recorded.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

PATCH_TYPES = {"application/merge-patch+json", "application/strategic-merge-patch+json"}


@dataclass
class FakeDeployment:
    replicas: int
    labels: dict[str, str]


@dataclass
class FakePod:
    name: str
    labels: dict[str, str]
    phase: str = "Running"
    ready: bool = True
    ip: str | None = "127.0.0.1"
    deleting: bool = False


@dataclass
class Recorded:
    method: str
    path: str
    content_type: str | None
    body: Any


@dataclass
class FakeKube:
    namespace: str = "llm"
    deployments: dict[str, FakeDeployment] = field(default_factory=dict)
    pods: list[FakePod] = field(default_factory=list)
    # LeaderWorkerSets by name; ``labels`` of one is its hpaPodSelector (its leader pods' labels)
    lws: dict[str, FakeDeployment] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Deployments whose scale subresource the caller may get/patch (RBAC resourceNames); None = all.
    scale_allowed: set[str] | None = None

    def forbidden(self, kind: str, name: str | None) -> bool:
        return kind in ("scale", "lws_scale") and self.scale_allowed is not None and name not in self.scale_allowed

    def table(self, kind: str) -> dict[str, FakeDeployment]:
        return self.lws if kind.startswith("lws") else self.deployments

    def scale_json(self, name: str, kind: str = "scale") -> dict[str, Any]:
        d = self.table(kind)[name]
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": "1"},
            "spec": {"replicas": d.replicas},
            "status": {"replicas": d.replicas, "selector": ",".join(f"{k}={v}" for k, v in sorted(d.labels.items()))},
        }

    def deployment_json(self, name: str) -> dict[str, Any]:
        d = self.deployments[name]
        return {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"replicas": d.replicas, "selector": {"matchLabels": d.labels},
                     "template": {"metadata": {"labels": d.labels},
                                  "spec": {"containers": [{"name": "c", "image": "pdserve"}]}}},
        }

    def pod_list_json(self, selector: str) -> dict[str, Any]:
        wanted = dict(kv.split("=", 1) for kv in selector.split(",") if kv) if selector else {}
        items = []
        for p in self.pods:
            if not wanted.items() <= p.labels.items():
                continue
            meta: dict[str, Any] = {"name": p.name, "namespace": self.namespace, "labels": p.labels}
            if p.deleting:
                meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            status: dict[str, Any] = {"phase": p.phase,
                                      "conditions": [{"type": "Ready", "status": "True" if p.ready else "False"}]}
            if p.ip:
                status["podIP"] = p.ip
            items.append({"metadata": meta, "spec": {"containers": [{"name": "c", "image": "pdserve"}]},
                          "status": status})
        return {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "message": message, "reason": reason,
            "code": code}


def make_handler(state: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> tuple[str, str | None, dict[str, list[str]]]:
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            query = parse_qs(url.query)
            ns = state.namespace
            if parts[:4] == ["apis", "apps", "v1", "namespaces"] and len(parts) >= 7 and parts[4] == ns \
                    and parts[5] == "deployments":
                kind = "scale" if len(parts) == 8 and parts[7] == "scale" else "deployment" if len(parts) == 7 else ""
                return kind, parts[6], query
            if parts[:4] == ["apis", "leaderworkerset.x-k8s.io", "v1", "namespaces"] and len(parts) == 8 \
                    and parts[4] == ns and parts[5] == "leaderworkersets" and parts[7] == "scale":
                return "lws_scale", parts[6], query
            if parts == ["api", "v1", "namespaces", ns, "pods"]:
                return "pods", None, query
            return "", None, query

        def _record(self, body: Any = None) -> None:
            with state.lock:
                state.requests.append(Recorded(self.command, self.path, self.headers.get("Content-Type"), body))

        def do_GET(self) -> None:
            self._record()
            kind, name, query = self._route()
            if state.forbidden(kind, name):
                return self._send(403, _status(403, "Forbidden", f"cannot get deployments/scale {name}"))
            with state.lock:
                if kind == "pods":
                    return self._send(200, state.pod_list_json(query.get("labelSelector", [""])[0]))
                if kind in ("scale", "deployment", "lws_scale") and name in state.table(kind):
                    return self._send(200, state.deployment_json(name) if kind == "deployment"
                                      else state.scale_json(name, kind))
            self._send(404, _status(404, "NotFound", f"{self.path} not found"))

        def do_PATCH(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            try:
                body = json.loads(raw or b"null")
            except ValueError:
                body = None
            self._record(body)
            kind, name, _ = self._route()
            if state.forbidden(kind, name):
                return self._send(403, _status(403, "Forbidden", f"cannot patch deployments/scale {name}"))
            if kind not in ("scale", "lws_scale") or name not in state.table(kind):
                return self._send(404, _status(404, "NotFound", f"{self.path} not found"))
            if ctype not in PATCH_TYPES:
                return self._send(415, _status(415, "UnsupportedMediaType",
                                               f"the body of the request was in an unknown format ({ctype})"))
            if not isinstance(body, dict):
                return self._send(400, _status(400, "BadRequest", "patch body is not a JSON object"))
            replicas = (body.get("spec") or {}).get("replicas")
            if replicas is not None:
                if not isinstance(replicas, int) or replicas < 0:
                    return self._send(422, _status(422, "Invalid",
                                                   f"Scale.autoscaling \"{name}\" is invalid: spec.replicas: "
                                                   f"Invalid value: {replicas}: must be greater than or equal to 0"))
                with state.lock:
                    state.table(kind)[name].replicas = replicas
            with state.lock:
                self._send(200, state.scale_json(name, kind))

    return Handler


class FakeKubeServer:
    """Serves a :class:`FakeKube` on 127.0.0.1 (free port) from a background thread; use as a context manager."""

    def __init__(self, state: FakeKube) -> None:
        self.state = state
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeKubeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
