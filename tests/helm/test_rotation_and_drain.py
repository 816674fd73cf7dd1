"""Rotating an API key with ``helm upgrade`` rolls the router pods; the router's drain fits its termination budget.

Oracle: the rendered pod templates (a Deployment rolls exactly when its pod template changes) and the router's own
settings class reading the environment the chart sets.
"""

from __future__ import annotations

import pytest

from chart_render import RELEASE, by_kind, helm, render_docs

FULL = f"{RELEASE}-pdserve"


def templates(chart, values) -> dict[str, dict]:
    return {name.removeprefix(f"{FULL}-"): d["spec"]["template"]
            for name, d in by_kind(render_docs(chart, values), "Deployment").items()}


def test_a_new_api_key_changes_the_router_pod_template_and_only_its(chart):
    old = templates(chart, {"secrets": {"apiKeys": ["key-one"]}})
    new = templates(chart, {"secrets": {"apiKeys": ["key-two"]}})
    assert old["router"] != new["router"]
    assert old["router"]["metadata"]["annotations"]["checksum/secrets"] != \
        new["router"]["metadata"]["annotations"]["checksum/secrets"]
    for tier in ("registry", "prefill", "decode"):  # they do not read the keys: no needless model reloads
        assert old[tier] == new[tier], tier
    same = templates(chart, {"secrets": {"apiKeys": ["key-one"]}})
    assert same["router"] == old["router"]  # a plain upgrade with the same keys rolls nothing


def test_an_existing_secret_gets_no_checksum(chart):
    router = templates(chart, {"secrets": {"existingSecret": "mine"}})["router"]
    assert "checksum/secrets" not in router["metadata"]["annotations"]


def test_the_router_drains_within_its_termination_grace_period(chart):
    from pdserve.services.router.settings import RouterSettings

    router = templates(chart, {"router": {"shutdownGraceSeconds": 50, "preStopSleepSeconds": 7,
                                          "terminationGracePeriodSeconds": 70}})["router"]
    spec = router["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert RouterSettings(_env_file=None, **{"shutdown_grace_s": env["PDSERVE_SHUTDOWN_GRACE_S"]}).shutdown_grace_s == 50
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "7"]}}}
    assert spec["terminationGracePeriodSeconds"] == 70
    default = templates(chart, {})["router"]["spec"]
    assert default["terminationGracePeriodSeconds"] >= 5 + 30 + 5


def test_a_termination_grace_period_shorter_than_the_drain_is_refused(chart):
    with pytest.raises(helm.HelmError) as err:
        chart.render({"router": {"shutdownGraceSeconds": 60, "terminationGracePeriodSeconds": 30}},
                     name=RELEASE, namespace="llm")
    assert "router.terminationGracePeriodSeconds (30) must be at least" in str(err.value)


def test_the_in_chart_redis_requires_a_generated_password_by_default(chart):
    import base64

    docs = render_docs(chart, {})
    (redis,) = by_kind(docs, "StatefulSet").values()
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    password = base64.b64decode(by_kind(docs, "Secret")[f"{FULL}-redis"]["data"]["redis-password"]).decode()
    assert len(password) == 48
    for name, deploy in by_kind(docs, "Deployment").items():
        (c,) = deploy["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c.get("env", [])}
        if name.endswith("-planner"):
            continue
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-redis", "key": "redis-password"}
        assert env["PDSERVE_REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@{FULL}-redis:6379/0", name
