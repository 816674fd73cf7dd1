"""The chart's dashboard and alert rules, rendered and turned into what Grafana and Prometheus read.

Shared by tests/helm/test_observability.py (chart, promtool) and tests/e2e/test_preemption_and_metrics.py (a real
Prometheus scraping a real ``pdserve up``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from support.chart_render import CHART, RELEASE, by_kind, render_docs

FULL = f"{RELEASE}-pdserve"
ENABLED = {"grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True}}
# What Grafana substitutes in a panel's query before Prometheus sees it.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "${datasource}": "prometheus"}


def render_observability(chart, values: dict[str, Any] | None = None) -> tuple[dict, dict]:
    """(the dashboards ConfigMap, the PrometheusRule) rendered with both enabled (plus ``values``)."""
    docs = render_docs(chart, {**ENABLED, **(values or {})})
    return by_kind(docs, "ConfigMap")[f"{FULL}-dashboards"], by_kind(docs, "PrometheusRule")[FULL]


def rule_file(prometheus_rule: dict) -> dict:
    """The PrometheusRule's spec as a Prometheus rule file (what the Prometheus Operator writes for Prometheus)."""
    return {"groups": prometheus_rule["spec"]["groups"]}


def rules(prometheus_rule: dict, kind: str) -> list[dict]:
    """Every rule of ``kind`` ("record" or "alert")."""
    return [r for g in prometheus_rule["spec"]["groups"] for r in g["rules"] if kind in r]


def dashboard_queries(configmap: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables substituted) of every panel target of every dashboard."""
    out = []
    for text in configmap["data"].values():
        for panel in json.loads(text)["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for var, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(var, value)
                out.append((panel["title"], expr))
    return out


def runbook_anchors(doc: Path) -> set[str]:
    """GitHub's anchors of the headings of ``doc`` (lower case, spaces to dashes, punctuation dropped)."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in heads}


REPO = CHART.parents[1]
