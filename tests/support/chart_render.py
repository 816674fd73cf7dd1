"""Render helm/pdserve with Helm's own engine (helm-python-sdk binds Helm's Go SDK; no helm binary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm  # noqa: F401  (pip install helm-python-sdk; tests import it from here)
import yaml

REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository
CHART = REPO / "helm" / "pdserve"
RELEASE = "demo"
NAMESPACE = "llm"

# The values the chart must render: its defaults, and one file per mode.
VALUES_FILES = {
    "default": None,
    "hpa": CHART / "ci" / "hpa-values.yaml",
    "keda": CHART / "ci" / "keda-values.yaml",
    "planner": CHART / "ci" / "planner-values.yaml",
    "external-redis": CHART / "ci" / "external-redis-values.yaml",
    "gpu": CHART / "values-gpu.yaml",
    "multinode": CHART / "ci" / "multinode-values.yaml",
}


# libyaml's parser: the pure-Python one spent ~85% of the helm tests' time parsing rendered manifests
# (tests/README.md "Tiers": the fast tier's budget).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_all(text: str) -> list[Any]:
    """Every YAML document in ``text`` (``yaml.safe_load_all``, with libyaml when it is there)."""
    return list(yaml.load_all(text, Loader=_LOADER))


def load_values(case: str) -> dict[str, Any]:
    path = VALUES_FILES[case]
    return yaml.load(path.read_text(), Loader=_LOADER) if path else {}


def render_docs(chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders for ``values`` (NOTES.txt and empty documents dropped)."""
    manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("namespace", NAMESPACE)
                docs.append(doc)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod templates a workload runs: ``{"": template}`` for a Deployment, StatefulSet or Job; ``{"leader": ...,
    "worker": ...}`` for a LeaderWorkerSet (the chart's multi-node tiers); ``{}`` for anything else."""
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return {"": doc["spec"]["template"]}
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return {"leader": lwt.get("leaderTemplate", lwt["workerTemplate"]), "worker": lwt["workerTemplate"]}
    return {}


def pod_template(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The pod template of the tier workload ``name``: a Deployment's, or a LeaderWorkerSet's leader's (the pod that
    serves the tier)."""
    (doc,) = [d for d in docs if d["metadata"]["name"] == name and d["kind"] in ("Deployment", "LeaderWorkerSet")]
    return pod_templates(doc).get("", pod_templates(doc).get("leader"))
