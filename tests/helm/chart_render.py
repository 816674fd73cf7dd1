"""Render helm/pdserve with Helm's own engine (helm-python-sdk binds Helm's Go SDK; no helm binary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm  # pip install helm-python-sdk
import yaml

REPO = Path(__file__).resolve().parents[2]
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
}


def load_values(case: str) -> dict[str, Any]:
    path = VALUES_FILES[case]
    return yaml.safe_load(path.read_text()) if path else {}


def render_docs(chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders for ``values`` (NOTES.txt and empty documents dropped)."""
    manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("namespace", NAMESPACE)
                docs.append(doc)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}
