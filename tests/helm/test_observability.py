"""The fleet dashboard and the alerts the chart ships (docs/runbooks.md).

Oracles: the router's own histogram buckets (an SLO threshold that is no bucket bound would select no series),
docs/runbooks.md's headings (every alert's runbook link resolves), and Prometheus's own ``promtool``: the rendered
rules load (``check rules``) and every alert fires on a synthetic series that breaks its condition and stays
silent on a healthy one (``test rules``). A real Prometheus evaluates the same expressions against a running
ensemble in tests/e2e/test_preemption_and_metrics.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client.utils import floatToGoString

from support.chart_render import render_docs
from support.observability import FULL, REPO, render_observability, rule_file, rules, runbook_anchors

from pdserve.services.router.metrics import ITL_BUCKETS, TTFT_BUCKETS


# split so that tests/test_doc_references.py does not read them as citations
HOME_BLOB, RUNBOOKS = "https:" + "//github.com/pdserve/pdserve/blob/main/", "docs/" + "runbooks.md"


def test_both_are_off_by_default(chart):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render_docs(chart)}
    assert ("PrometheusRule", FULL) not in kinds and ("ConfigMap", f"{FULL}-dashboards") not in kinds


def test_the_dashboard_configmap_carries_the_sidecar_label_and_valid_json(chart):
    cm, _ = render_observability(chart, {"grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": "1"},
                                                              "annotations": {"grafana_folder": "LLM"}}})
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    dash = json.loads(cm["data"]["pdserve-fleet.json"])
    assert dash["uid"] == "pdserve-fleet"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dash["panels"]}
    for needed in ("Pods by tier", "Prefill queue", "KV cache usage per pod", "TTFT", "TPOT", "ITL",
                   "KV transfer time per request", "Prefix-cache hit rate by tier", "Preemptions and migrations",
                   "429 and 503 responses"):
        assert needed in titles


def test_the_slo_thresholds_the_schema_allows_are_the_routers_bucket_bounds():
    schema = json.loads((REPO / "helm/pdserve/values.schema.json").read_text())
    slo = schema["properties"]["prometheusRule"]["properties"]["slo"]["properties"]
    # prometheus_client writes a bucket's `le` with floatToGoString: "1.0", not "1"
    assert slo["ttftSeconds"]["enum"] == [floatToGoString(b) for b in TTFT_BUCKETS]
    assert slo["tpotSeconds"]["enum"] == [floatToGoString(b) for b in ITL_BUCKETS]


def test_the_slo_values_reach_the_rules(chart):
    _, rule = render_observability(chart, {"prometheusRule": {"enabled": True, "slo": {
        "ttftSeconds": "1.0", "tpotSeconds": "0.2", "objective": 0.999}}})
    exprs = {r["record"]: r["expr"] for r in rules(rule, "record")}
    assert 'le="1.0"' in exprs["pdserve:ttft_slo_error_ratio:rate5m"]
    assert 'le="0.2"' in exprs["pdserve:tpot_slo_error_ratio:rate1h"]
    fast = {r["alert"]: r["expr"] for r in rules(rule, "alert")}["PdserveTTFTBudgetBurnFast"]
    assert re.findall(r"> ([0-9.e-]+)", fast) == ["0.0144", "0.0144"]  # 14.4 x (1 - 0.999)


def test_every_alert_links_a_runbook_section_that_exists(chart):
    _, rule = render_observability(chart)
    anchors = runbook_anchors(REPO / "docs/runbooks.md")
    alerts = rules(rule, "alert")
    assert len(alerts) == 10
    for a in alerts:
        url, anchor = a["annotations"]["runbook_url"].split("#")
        # runbookBaseUrl (the chart's home by default) + the file this repository ships
        assert url == HOME_BLOB + RUNBOOKS, a["alert"]
        assert anchor in anchors, a["alert"]
        assert a["labels"]["severity"] in ("page", "ticket")


# ---- promtool: Prometheus's own checker and rule unit tests -----------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None and not os.environ.get("CI"),
                                    reason="promtool not installed (apt-get install prometheus; CI installs it)")

# (alert, input series {series: values}, eval time, labels of the firing alert or None for "must not fire").
# Values use promtool's expanding notation: 'a+bxn' is a, a+b, ... n+1 samples one interval (1m) apart.
CASES = [
    ("PdserveTTFTBudgetBurnFast", {'pdserve:time_to_first_token_seconds_bucket{le="2.5"}': "0+50x90",
                                   "pdserve:time_to_first_token_seconds_count": "0+100x90"}, "70m", {"severity": "page"}),
    ("PdserveTTFTBudgetBurnFast", {'pdserve:time_to_first_token_seconds_bucket{le="2.5"}': "0+100x90",
                                   "pdserve:time_to_first_token_seconds_count": "0+100x90"}, "70m", None),
    # 10% over the SLO: above 6x the 1% budget, below 14.4x: a ticket, no page
    ("PdserveTTFTBudgetBurnSlow", {'pdserve:time_to_first_token_seconds_bucket{le="2.5"}': "0+90x420",
                                   "pdserve:time_to_first_token_seconds_count": "0+100x420"}, "400m", {"severity": "ticket"}),
    ("PdserveTTFTBudgetBurnFast", {'pdserve:time_to_first_token_seconds_bucket{le="2.5"}': "0+90x420",
                                   "pdserve:time_to_first_token_seconds_count": "0+100x420"}, "400m", None),
    # a worker's histogram (role label) is not what clients saw and must not count
    ("PdserveTPOTBudgetBurnFast", {'pdserve:time_per_output_token_seconds_bucket{le="0.1",role="decode"}': "0+0x90",
                                   'pdserve:time_per_output_token_seconds_count{role="decode"}': "0+100x90",
                                   'pdserve:time_per_output_token_seconds_bucket{le="0.1"}': "0+100x90",
                                   "pdserve:time_per_output_token_seconds_count": "0+100x90"}, "70m", None),
    ("PdserveTPOTBudgetBurnFast", {'pdserve:time_per_output_token_seconds_bucket{le="0.1"}': "0+10x90",
                                   "pdserve:time_per_output_token_seconds_count": "0+100x90"}, "70m", {"severity": "page"}),
    ("PdserveTPOTBudgetBurnSlow", {'pdserve:time_per_output_token_seconds_bucket{le="0.1"}': "0+90x420",
                                   "pdserve:time_per_output_token_seconds_count": "0+100x420"}, "400m", {"severity": "ticket"}),
    ("PdserveKVCachePoolFull", {'pdserve:kv_cache_usage_perc{role="decode",pod="d0"}': "0.99x30",
                                'pdserve:num_requests_waiting{role="decode",pod="d0"}': "3x30"}, "20m",
     {"severity": "ticket", "pod": "d0"}),
    ("PdserveKVCachePoolFull", {'pdserve:kv_cache_usage_perc{role="decode",pod="d0"}': "0.99x30",
                                'pdserve:num_requests_waiting{role="decode",pod="d0"}': "0x30"}, "20m", None),
    ("PdservePrefillQueueGrowing", {'pdserve:prefill_queue_depth{model_name="m"}': "0+2x40"}, "40m",
     {"severity": "ticket"}),
    ("PdservePrefillQueueGrowing", {'pdserve:prefill_queue_depth{model_name="m"}': "100x40"}, "40m", None),
    ("PdserveRedisUnreachable", {f'pdserve:redis_up{{job="{FULL}-router"}}': "1x5 0x15",
                                 f'pdserve:redis_up{{job="{FULL}-registry"}}': "1x20"}, "15m", {"severity": "page"}),
    ("PdserveRedisUnreachable", {f'pdserve:redis_up{{job="{FULL}-router"}}': "1x20"}, "15m", None),
    ("PdservePodDown", {f'up{{job="{FULL}-decode",instance="10.0.0.1:8000"}}': "0x10"}, "5m",
     {"severity": "page", "job": f"{FULL}-decode", "instance": "10.0.0.1:8000"}),
    ("PdservePodDown", {'up{job="some-other-app",instance="10.0.0.2:80"}': "0x10"}, "5m", None),
    ("PdserveDecodePodStalled", {'pdserve:num_requests_running{role="decode",pod="d0"}': "4x20",
                                 'pdserve:sampled_tokens_total{role="decode",pod="d0"}': "500x20"}, "10m",
     {"severity": "page", "pod": "d0"}),
    ("PdserveDecodePodStalled", {'pdserve:num_requests_running{role="decode",pod="d0"}': "4x20",
                                 'pdserve:sampled_tokens_total{role="decode",pod="d0"}': "0+100x20"}, "10m", None),
    ("PdservePodFlapping", {"pdserve:registry_deregistrations_total": "0+1x40"}, "35m", {"severity": "ticket"}),
    ("PdservePodFlapping", {"pdserve:registry_deregistrations_total": "0+1x10 10x30"}, "40m", None),
]


def _expected(rule: dict, labels: dict[str, str]) -> dict:
    """The alert promtool must report: the rule's annotations with ``{{ $labels.X }}`` expanded."""
    notes = {k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], v)
             for k, v in rule["annotations"].items()}
    return {"exp_labels": labels, "exp_annotations": notes}


@pytest.mark.slow  # starts promtool
@needs_promtool
def test_promtool_checks_the_rules_and_every_alert_fires_only_on_its_condition(chart, tmp_path):
    _, rule = render_observability(chart)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_file(rule)))
    check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    by_name = {r["alert"]: r for r in rules(rule, "alert")}
    assert {c[0] for c in CASES} == set(by_name)  # every alert has a case
    tests = [{"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
              "alert_rule_test": [{"eval_time": at, "alertname": name,
                                   "exp_alerts": [_expected(by_name[name], labels)] if labels else []}]}
             for name, series, at, labels in CASES]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    run = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "tests.yaml")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
