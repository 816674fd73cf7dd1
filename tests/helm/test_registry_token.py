"""The registry's bearer token: one value in the chart's Secret reaches the registry and every caller of it.

Oracle: the Secret's data (base64-decoded), and the services' own settings classes (RegistrySettings,
RouterSettings, WorkerSettings) reading the environment variable the chart sets. The planner never calls the registry
(helm/pdserve/README.md "Network policies"), so it must not get the token.
"""

from __future__ import annotations

import base64

import pytest

from chart_render import RELEASE, by_kind, helm, load_values, render_docs

FULL = f"{RELEASE}-pdserve"
CALLERS = ("registry", "router", "prefill", "decode")


def token_refs(docs) -> dict[str, dict]:
    """Deployment suffix -> the secretKeyRef of its PDSERVE_REGISTRY_TOKEN (absent: no such variable)."""
    refs = {}
    for name, deploy in by_kind(docs, "Deployment").items():
        (c,) = deploy["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", []):
            if e["name"] == "PDSERVE_REGISTRY_TOKEN":
                refs[name.removeprefix(f"{FULL}-")] = e["valueFrom"]["secretKeyRef"]
    return refs


def secret_value(docs, ref: dict) -> str:
    return base64.b64decode(by_kind(docs, "Secret")[ref["name"]]["data"][ref["key"]]).decode()


def test_default_install_generates_one_token_for_the_registry_and_its_callers_only(chart):
    values = load_values("planner")  # a planner too: it must not get the token
    del values["secrets"]["registryToken"]
    docs = render_docs(chart, values)
    refs = token_refs(docs)
    assert sorted(refs) == sorted(CALLERS)
    assert all(ref == {"name": f"{FULL}-secrets", "key": "registry-token"} for ref in refs.values())
    token = secret_value(docs, refs["registry"])
    assert len(token) == 48 and token.isalnum()
    # a second install gets another token (randAlphaNum, not a constant baked into the chart)
    assert secret_value(render_docs(chart, {}), refs["registry"]) != token


def plain(value) -> str:
    return value.get_secret_value() if hasattr(value, "get_secret_value") else value


def test_a_given_token_is_what_registry_router_and_workers_read(chart, monkeypatch):
    from pdserve.services.registry.settings import RegistrySettings
    from pdserve.services.router.settings import RouterSettings
    from pdserve.shared.worker.settings import WorkerSettings

    docs = render_docs(chart, {"secrets": {"registryToken": "tok-3f9a.b_c~d"}})
    refs = token_refs(docs)
    values = {tier: secret_value(docs, refs[tier]) for tier in CALLERS}
    assert set(values.values()) == {"tok-3f9a.b_c~d"}
    monkeypatch.setenv("PDSERVE_REGISTRY_TOKEN", values["registry"])
    assert RegistrySettings().auth_token.get_secret_value() == "tok-3f9a.b_c~d"
    monkeypatch.setenv("PDSERVE_REGISTRY_TOKEN", values["router"])
    assert plain(RouterSettings().registry_token) == "tok-3f9a.b_c~d"
    for tier in ("prefill", "decode"):
        monkeypatch.setenv("PDSERVE_REGISTRY_TOKEN", values[tier])
        assert WorkerSettings().registry_token.get_secret_value() == "tok-3f9a.b_c~d"
    # the KV-transfer secret is still its own value
    data = by_kind(docs, "Secret")[f"{FULL}-secrets"]["data"]
    assert base64.b64decode(data["kv-transfer-secret"]).decode() != "tok-3f9a.b_c~d"


def test_an_existing_secret_is_read_under_the_configured_key(chart):
    docs = render_docs(chart, {"secrets": {"existingSecret": "team-keys", "registryTokenKey": "reg"}})
    assert f"{FULL}-secrets" not in by_kind(docs, "Secret")
    refs = token_refs(docs)
    assert sorted(refs) == sorted(CALLERS)
    assert all(ref == {"name": "team-keys", "key": "reg"} for ref in refs.values())


@pytest.mark.parametrize("bad", ["two words", "tab\there", "caf\u00e9"])
def test_schema_refuses_a_token_that_cannot_travel_in_a_header(chart, bad):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render({"secrets": {"registryToken": bad}}, name="demo", namespace="llm")
    assert "/secrets/registryToken" in str(err.value), str(err.value)
