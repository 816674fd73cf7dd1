"""The chart renders for every mode, lints clean, and every manifest is a valid Kubernetes object.

Oracles: Helm's own engine and linter (helm-python-sdk), and the Kubernetes OpenAPI schemas in
``kubernetes-validate`` (strict: unknown fields are errors) for Kubernetes 1.29 and 1.33.
"""

from __future__ import annotations

import kubernetes_validate
import pytest

from chart_render import CHART, VALUES_FILES, by_kind, helm, load_values
from lws_schema import validate_leaderworkerset

KUBE_VERSIONS = ["1.29", "1.33"]

# Custom resources have no schema in kubernetes-validate (it ships only the core API's OpenAPI). Their
# required fields are checked by the tests below instead, against what KEDA, the Prometheus operator and
# Gateway API document as required. A LeaderWorkerSet is validated against our schema of its CRD (lws_schema.py),
# its pod templates against the core API's.
CRD_KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_manifest_validates_strictly(rendered, kube_version):
    case, docs = rendered
    errors = []
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        if doc["kind"] == "LeaderWorkerSet":
            errors += [f"LeaderWorkerSet/{doc['metadata']['name']}: {e}" for e in validate_leaderworkerset(doc, kube_version)]
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, f"[{case}] " + "\n".join(errors)


def test_a_broken_manifest_is_caught_by_the_validator(chart):
    """The oracle itself can fail: a typo'd field in a rendered Deployment is rejected in strict mode."""
    from chart_render import render_docs

    deploy = next(d for d in render_docs(chart) if d["kind"] == "Deployment")
    deploy["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, "1.29", strict=True)


@pytest.mark.parametrize("kube_version", ["v1.29.0", "v1.33.0"])
@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_lint_reports_no_errors_or_warnings(case, kube_version):
    report = helm.lint(CHART, load_values(case), strict=True, kube_version=kube_version)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_custom_resources_carry_their_required_fields(rendered):
    case, docs = rendered
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    for so in by_kind(docs, "ScaledObject").values():
        ref = so["spec"]["scaleTargetRef"]
        assert ref["name"] in deployments, (case, ref)
        assert so["spec"]["triggers"], case
        for trig in so["spec"]["triggers"]:
            assert trig["type"] and isinstance(trig["metadata"], dict), trig
            assert all(isinstance(v, str) for v in trig["metadata"].values()), f"KEDA metadata values are strings: {trig}"
            if "authenticationRef" in trig:
                assert trig["authenticationRef"]["name"] in by_kind(docs, "TriggerAuthentication")
        assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    for ta in by_kind(docs, "TriggerAuthentication").values():
        for ref in ta["spec"]["secretTargetRef"]:
            assert ref["parameter"] and ref["name"] and ref["key"], ref
    for sm in by_kind(docs, "ServiceMonitor").values():
        wanted = sm["spec"]["selector"]["matchLabels"]
        matched = [s for s in services.values() if wanted.items() <= s["metadata"]["labels"].items()]
        assert {s["metadata"]["name"].rsplit("-", 1)[-1] for s in matched} >= {"router", "registry", "prefill", "decode"}
        for ep in sm["spec"]["endpoints"]:
            for s in matched:
                assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}, (s["metadata"]["name"], ep)
    for route in by_kind(docs, "HTTPRoute").values():
        assert route["spec"]["parentRefs"] and all("name" in p for p in route["spec"]["parentRefs"])
        for rule in route["spec"]["rules"]:
            for backend in rule["backendRefs"]:
                svc = services[backend["name"]]
                assert backend["port"] in {p["port"] for p in svc["spec"]["ports"]}


def test_every_mode_renders_its_autoscaler(chart):
    from chart_render import render_docs

    kinds = {case: {d["kind"] for d in render_docs(chart, load_values(case))} for case in ("default", "hpa", "keda", "planner")}
    scalers = {"HorizontalPodAutoscaler", "ScaledObject"}
    assert not kinds["default"] & scalers and "Role" not in kinds["default"]
    assert "HorizontalPodAutoscaler" in kinds["hpa"] and "ScaledObject" not in kinds["hpa"]
    assert "ScaledObject" in kinds["keda"] and "HorizontalPodAutoscaler" not in kinds["keda"]
    assert {"Role", "RoleBinding"} <= kinds["planner"] and not kinds["planner"] & scalers


def test_values_schema_file_is_current():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_values_schema", CHART.parent / "tools" / "gen_values_schema.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (CHART / "values.schema.json").read_text() == gen.render(), "run: python helm/tools/gen_values_schema.py"


def test_values_schema_accepts_exactly_the_speculative_config_fields_of_the_engine():
    import json
    from dataclasses import fields

    from pdserve.shared.engine.spec_decode.config import METHODS, SpeculativeConfig

    schema = json.loads((CHART / "values.schema.json").read_text())
    spec = schema["properties"]["decode"]["properties"]["speculativeConfig"]
    assert list(spec["properties"]) == [f.name for f in fields(SpeculativeConfig)]
    assert spec["properties"]["method"] == {"enum": list(METHODS)} and spec["additionalProperties"] is False


@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_notes_tell_how_to_reach_the_router_and_how_it_scales(chart, case):
    values = load_values(case)
    notes = chart.render(values, name="demo", namespace="llm", is_install=True)["pdserve/templates/NOTES.txt"]
    mode = chart.merge_values(values)["autoscaling"]["mode"]
    assert f"3. Autoscaling: {mode}" in notes
    assert "/v1/chat/completions" in notes
    assert "demo-pdserve-router" in notes or "llm.example.com" in notes or "inference-gateway" in notes
