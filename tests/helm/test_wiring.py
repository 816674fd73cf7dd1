"""The rendered objects fit together: selectors, references, ports, env, per-mode autoscaling."""

from __future__ import annotations

import pytest

from chart_render import RELEASE, by_kind, load_values, pod_template, pod_templates, render_docs

FULL = f"{RELEASE}-pdserve"
TIERS = ("router", "registry", "prefill", "decode")


def pod_specs(docs):
    """(owner, pod spec, pod labels) for every workload that runs pods (a LeaderWorkerSet: its leader and worker
    pods)."""
    for d in docs:
        for role, t in pod_templates(d).items():
            yield f"{d['kind']}/{d['metadata']['name']}{'#' + role if role else ''}", t["spec"], t["metadata"].get("labels", {})


def containers(docs, name):
    return pod_template(docs, name)["spec"]["containers"]


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def test_every_service_selects_the_pods_of_its_workload(rendered):
    case, docs = rendered
    # (workload, pod template): a LeaderWorkerSet's worker pods are no Service's (only its leader serves the tier)
    workloads = [(d, t) for d in docs if d["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet")
                 for role, t in pod_templates(d).items() if role != "worker"]
    for svc in by_kind(docs, "Service").values():
        sel = svc["spec"]["selector"]
        matching = [(w, t) for w, t in workloads if sel.items() <= t["metadata"]["labels"].items()]
        assert len(matching) == 1, (case, svc["metadata"]["name"], sel)
        workload, template = matching[0]
        # The Service fronts the workload of its own name (<fullname>-<tier>, Redis also via "-headless").
        assert workload["metadata"]["name"] == svc["metadata"]["name"].removesuffix("-headless"), (case, sel)
        # ...and the workload's own selector agrees with its pod labels (an LWS has none: it selects by its own).
        if "selector" in workload["spec"]:
            assert workload["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        # Each Service port targets a named container port that exists.
        names = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    for tier in TIERS:
        assert f"{FULL}-{tier}" in by_kind(docs, "Service"), (case, tier)


def test_every_pdb_selects_a_tier(rendered):
    case, docs = rendered
    labels = [lbl for _, _, lbl in pod_specs(docs)]
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert sum(sel.items() <= lbl.items() for lbl in labels) == 1, (case, pdb["metadata"]["name"])


def referenced(spec):
    """Secret and ConfigMap names a pod spec references (env, envFrom, volumes), with the optional flag."""
    refs = []
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        for src in c.get("envFrom", []):
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in src:
                    refs.append((kind, src[key]["name"], src[key].get("optional", False)))
        for e in c.get("env", []):
            vf = e.get("valueFrom", {})
            for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                if key in vf:
                    refs.append((kind, vf[key]["name"], vf[key].get("optional", False), vf[key]["key"]))
    for v in spec.get("volumes", []):
        if "secret" in v:
            refs.append(("Secret", v["secret"]["secretName"], v["secret"].get("optional", False)))
        if "configMap" in v:
            refs.append(("ConfigMap", v["configMap"]["name"], v["configMap"].get("optional", False)))
    return refs


def test_every_secret_and_configmap_a_pod_reads_is_rendered_with_that_key(rendered):
    case, docs = rendered
    objects = {("Secret", n): d for n, d in by_kind(docs, "Secret").items()}
    objects |= {("ConfigMap", n): d for n, d in by_kind(docs, "ConfigMap").items()}
    for owner, spec, _ in pod_specs(docs):
        for ref in referenced(spec):
            kind, name, optional = ref[:3]
            if optional:
                continue
            assert (kind, name) in objects, f"[{case}] {owner} reads {kind} {name}, which the chart does not render"
            if len(ref) == 4:
                data = objects[(kind, name)].get("data", {}) | objects[(kind, name)].get("stringData", {})
                assert ref[3] in data, f"[{case}] {owner} reads key {ref[3]} of {kind} {name}: keys {sorted(data)}"


def test_existing_secrets_are_referenced_not_rendered(chart):
    docs = render_docs(chart, {
        "secrets": {"existingSecret": "team-keys"},
        "redis": {"enabled": False, "external": {"existingSecret": "managed-redis", "existingSecretKey": "url"}},
    })
    assert not by_kind(docs, "Secret"), "no Secret is rendered when both are supplied"
    router = env_of(containers(docs, f"{FULL}-router")[0])
    assert router["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "team-keys", "key": "api-keys"}
    assert router["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "managed-redis", "key": "url"}
    decode = env_of(containers(docs, f"{FULL}-decode")[0])
    assert decode["PDSERVE_KV_TRANSFER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "team-keys"
    assert not by_kind(docs, "StatefulSet")


def test_probes_are_on_health_of_the_http_port(rendered):
    case, docs = rendered
    for d in by_kind(docs, "Deployment").values():
        (c,) = d["spec"]["template"]["spec"]["containers"]
        ports = {p["name"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (case, d["metadata"]["name"], probe)
        assert "http" in ports


def test_each_tier_runs_its_subcommand_on_its_contract_port(chart):
    docs = render_docs(chart, load_values("planner"))
    expected = {"router": 8000, "registry": 8001, "prefill": 8002, "decode": 8003, "planner": 8004}
    for tier, port in expected.items():
        (c,) = containers(docs, f"{FULL}-{tier}")
        assert c["args"] == [tier]
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == port
        assert env_of(c)["PDSERVE_PORT"]["value"] == str(port)
    (decode,) = containers(docs, f"{FULL}-decode")
    assert {p["name"]: p["containerPort"] for p in decode["ports"]}["kv"] == 9000
    headless = by_kind(docs, "Service")[f"{FULL}-decode"]
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {"http": 8003, "kv": 9000}


def test_pods_advertise_their_own_ip(rendered):
    case, docs = rendered
    for tier in TIERS:
        env = env_of(containers(docs, f"{FULL}-{tier}")[0])
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["PDSERVE_ADVERTISE_HOST"]["value"] == "$(POD_IP)"
        names = [e["name"] for e in containers(docs, f"{FULL}-{tier}")[0]["env"]]
        # Kubernetes expands $(VAR) only from variables defined earlier in the list.
        assert names.index("POD_IP") < names.index("PDSERVE_ADVERTISE_HOST")


def test_engine_settings_reach_every_tier_through_one_configmap(chart):
    values = {
        "model": {"name": "my-llama", "uri": "/models/llama", "dtype": "bfloat16"},
        "engine": {"blockSize": 32, "maxModelLen": 4096, "maxNumSeqs": 128, "maxNumBatchedTokens": 4096,
                   "enablePrefixCaching": False, "kvCacheMemory": "2GiB"},
        "routing": {"localPrefillThreshold": 96},
    }
    docs = render_docs(chart, values)
    cm = by_kind(docs, "ConfigMap")[f"{FULL}-config"]["data"]
    assert {k: v for k, v in cm.items() if k in {
        "PDSERVE_MODEL", "PDSERVE_SERVED_MODEL_NAME", "PDSERVE_DTYPE", "PDSERVE_BLOCK_SIZE", "PDSERVE_MAX_MODEL_LEN",
        "PDSERVE_MAX_NUM_SEQS", "PDSERVE_MAX_NUM_BATCHED_TOKENS", "PDSERVE_ENABLE_PREFIX_CACHING",
        "PDSERVE_KV_CACHE_MEMORY", "PDSERVE_LOCAL_PREFILL_THRESHOLD"}} == {
        "PDSERVE_MODEL": "/models/llama", "PDSERVE_SERVED_MODEL_NAME": "my-llama", "PDSERVE_DTYPE": "bfloat16",
        "PDSERVE_BLOCK_SIZE": "32", "PDSERVE_MAX_MODEL_LEN": "4096", "PDSERVE_MAX_NUM_SEQS": "128",
        "PDSERVE_MAX_NUM_BATCHED_TOKENS": "4096", "PDSERVE_ENABLE_PREFIX_CACHING": "false",
        "PDSERVE_KV_CACHE_MEMORY": "2GiB", "PDSERVE_LOCAL_PREFILL_THRESHOLD": "96"}
    assert "PDSERVE_REDIS_URL" not in cm  # it carries the in-chart Redis's password: from the Secret, per pod
    assert cm["PDSERVE_REGISTRY_URL"] == f"http://{FULL}-registry:8001"
    for tier in TIERS:
        (c,) = containers(docs, f"{FULL}-{tier}")
        assert {"configMapRef": {"name": f"{FULL}-config"}} in c["envFrom"]


def test_changing_the_config_rolls_the_pods(chart):
    a = by_kind(render_docs(chart, {}), "Deployment")[f"{FULL}-decode"]
    b = by_kind(render_docs(chart, {"engine": {"blockSize": 32, "maxModelLen": 2048, "maxNumSeqs": 64,
                                                "maxNumBatchedTokens": 2048}}), "Deployment")[f"{FULL}-decode"]
    key = "checksum/config"
    assert a["spec"]["template"]["metadata"]["annotations"][key] != b["spec"]["template"]["metadata"]["annotations"][key]


def test_redis_statefulset_persists_with_aof(chart):
    docs = render_docs(chart, {})
    sts = by_kind(docs, "StatefulSet")[f"{FULL}-redis"]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--dir") + 1] == "/data"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["resources"]["requests"]["storage"] == "8Gi"


def test_redis_password_reaches_the_url_without_landing_in_the_configmap(chart):
    docs = render_docs(chart, load_values("keda"))
    cm = by_kind(docs, "ConfigMap")[f"{FULL}-config"]["data"]
    assert "PDSERVE_REDIS_URL" not in cm
    (c,) = containers(docs, f"{FULL}-prefill")
    names = [e["name"] for e in c["env"]]
    env = env_of(c)
    assert env["PDSERVE_REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
    assert names.index("REDIS_PASSWORD") < names.index("PDSERVE_REDIS_URL")


def test_external_redis_url_comes_from_a_secret(chart):
    docs = render_docs(chart, load_values("external-redis"))
    assert not by_kind(docs, "StatefulSet")
    import base64

    secret = by_kind(docs, "Secret")[f"{FULL}-redis-url"]
    assert base64.b64decode(secret["data"]["redis-url"]).decode() == "redis://:s3cret@redis.data.svc.cluster.local:6379/0"
    for tier in TIERS:
        env = env_of(containers(docs, f"{FULL}-{tier}")[0])
        assert env["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULL}-redis-url"


def test_external_redis_without_url_fails_with_the_value_to_set(chart):
    with pytest.raises(Exception, match="redis.external.url"):
        render_docs(chart, {"redis": {"enabled": False}})


def test_api_keys_and_kv_secret(chart):
    import base64

    docs = render_docs(chart, load_values("planner"))
    data = by_kind(docs, "Secret")[f"{FULL}-secrets"]["data"]
    assert base64.b64decode(data["api-keys"]).decode() == "sk-team-a,sk-team-b"
    assert base64.b64decode(data["kv-transfer-secret"]).decode() == "not-so-secret-for-ci"
    # Default install: no keys (no auth), a generated KV secret of 48 characters.
    docs = render_docs(chart, {})
    data = by_kind(docs, "Secret")[f"{FULL}-secrets"]["data"]
    assert "api-keys" not in data and len(base64.b64decode(data["kv-transfer-secret"])) == 48
    assert "PDSERVE_API_KEY" not in env_of(containers(docs, f"{FULL}-router")[0])


def test_hpa_scales_prefill_on_backlog_per_replica_and_decode_on_kv_usage(chart):
    docs = render_docs(chart, load_values("hpa"))
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    prefill, decode = hpas[f"{FULL}-prefill"]["spec"], hpas[f"{FULL}-decode"]["spec"]
    assert prefill["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-prefill"}
    (m,) = prefill["metrics"]
    assert m["type"] == "External" and m["external"]["metric"]["name"] == "pdserve_prefill_queue_tokens"
    assert m["external"]["target"] == {"type": "AverageValue", "averageValue": "4096"}
    assert (prefill["minReplicas"], prefill["maxReplicas"]) == (1, 6)
    assert prefill["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    (m,) = decode["metrics"]
    assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == "pdserve_kv_cache_usage_perc"
    assert m["pods"]["target"] == {"type": "AverageValue", "averageValue": "700m"}
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 10)
    assert decode["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    deployments = by_kind(docs, "Deployment")
    # The autoscaler owns the replica count: a `helm upgrade` must not reset it.
    assert "replicas" not in deployments[f"{FULL}-prefill"]["spec"]
    assert "replicas" not in deployments[f"{FULL}-decode"]["spec"]
    assert deployments[f"{FULL}-router"]["spec"]["replicas"] == 2


def test_keda_scales_prefill_on_stream_lag_and_decode_on_prometheus(chart):
    docs = render_docs(chart, load_values("keda"))
    sos = by_kind(docs, "ScaledObject")
    (trig,) = sos[f"{FULL}-prefill"]["spec"]["triggers"]
    assert trig["type"] == "redis-streams"
    assert trig["metadata"] == {"address": f"{FULL}-redis.llm.svc:6379", "stream": "pdserve:{q-prefill}:queue",
                                "consumerGroup": "prefill", "lagCount": "8", "activationLagCount": "0"}
    auth = by_kind(docs, "TriggerAuthentication")[trig["authenticationRef"]["name"]]
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": f"{FULL}-redis", "key": "redis-password"}]
    (trig,) = sos[f"{FULL}-decode"]["spec"]["triggers"]
    assert trig["type"] == "prometheus" and trig["metricType"] == "Value"
    assert trig["metadata"]["query"] == f'avg(pdserve:kv_cache_usage_perc{{namespace="llm",pod=~"{FULL}-decode-.*"}})'
    assert trig["metadata"]["threshold"] == "0.8"
    assert sos[f"{FULL}-decode"]["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"] == 600


def test_keda_with_external_redis_needs_an_address(chart):
    with pytest.raises(Exception, match="redisAddress"):
        render_docs(chart, {"redis": {"enabled": False, "external": {"url": "redis://r:6379"}}, "autoscaling": {"mode": "keda"}})


@pytest.mark.parametrize("url, kind, extra", [
    ("redis+cluster://:pw@r0.data:6379,r1.data:6379", "redis-cluster-streams", {}),
    ("redis+sentinel://s0.data:26379,s1.data:26379/mymaster", "redis-sentinel-streams", {"sentinelMaster": "mymaster"}),
])
def test_an_external_cluster_or_sentinel_url_reaches_every_tier_and_picks_kedas_matching_scaler(chart, url, kind, extra):
    import base64

    addresses = "r0.data:6379,r1.data:6379" if "cluster" in url else "s0.data:26379,s1.data:26379"
    docs = render_docs(chart, {"redis": {"enabled": False, "external": {"url": url}},
                               "autoscaling": {"mode": "keda", "keda": {"redisAddress": addresses}}})
    assert base64.b64decode(by_kind(docs, "Secret")[f"{FULL}-redis-url"]["data"]["redis-url"]).decode() == url
    for tier in TIERS:
        env = env_of(containers(docs, f"{FULL}-{tier}")[0])
        assert env["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULL}-redis-url"
    (trig,) = by_kind(docs, "ScaledObject")[f"{FULL}-prefill"]["spec"]["triggers"]
    assert trig["type"] == kind
    assert trig["metadata"] == {"addresses": addresses, **extra, "stream": "pdserve:{q-prefill}:queue",
                                "consumerGroup": "prefill", "lagCount": "16", "activationLagCount": "0"}


def test_planner_gets_exactly_the_rbac_it_needs(chart):
    docs = render_docs(chart, load_values("planner"))
    role = by_kind(docs, "Role")[f"{FULL}-planner"]
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert grants == {("", "pods", v) for v in ("get", "list", "watch")} | {
        ("apps", "deployments", v) for v in ("get", "list", "watch")} | {
        ("apps", "deployments/scale", v) for v in ("get", "patch")}
    (scale_rule,) = [rule for rule in role["rules"] if "deployments/scale" in rule["resources"]]
    assert sorted(scale_rule["resourceNames"]) == [f"{FULL}-decode", f"{FULL}-prefill"], "it scales nothing else"
    binding = by_kind(docs, "RoleBinding")[f"{FULL}-planner"]
    planner = by_kind(docs, "Deployment")[f"{FULL}-planner"]["spec"]
    sa = planner["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "llm"}]
    assert sa in by_kind(docs, "ServiceAccount")
    assert planner["replicas"] == 1 and planner["strategy"] == {"type": "Recreate"}
    env = {e["name"]: e.get("value") for e in planner["template"]["spec"]["containers"][0]["env"]}
    assert env["PDSERVE_PREFILL_DEPLOYMENT"] == f"{FULL}-prefill"
    assert env["PDSERVE_DECODE_DEPLOYMENT"] == f"{FULL}-decode"
    assert (env["PDSERVE_PREFILL_MAX_REPLICAS"], env["PDSERVE_TTFT_SLO_SECONDS"], env["PDSERVE_TPOT_SLO_SECONDS"]) == ("6", "1.5", "0.08")
    # Its settings object must accept every variable the chart sets.
    from pdserve.services.planner.settings import PlannerSettings

    fields = {f"PDSERVE_{name.upper()}" for name in PlannerSettings.model_fields}
    chart_vars = {k for k in env if k.startswith("PDSERVE_")} - {"PDSERVE_ADVERTISE_HOST", "PDSERVE_REDIS_URL"}
    assert chart_vars <= fields, chart_vars - fields
    # The serving pods never get an API token.
    assert by_kind(docs, "ServiceAccount")[f"{FULL}"]["automountServiceAccountToken"] is False


def test_gpu_values_request_gpus_on_gpu_nodes(chart):
    docs = render_docs(chart, load_values("gpu"))
    for tier in ("prefill", "decode"):
        spec = by_kind(docs, "Deployment")[f"{FULL}-{tier}"]["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in spec["volumes"])
    for tier in ("router", "registry"):
        (c,) = containers(docs, f"{FULL}-{tier}")
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_loadtest_job_targets_the_router_service(chart):
    docs = render_docs(chart, load_values("planner"))
    (job,) = by_kind(docs, "Job").values()
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"][:6] == ["bench", "serve", "--base-url", f"http://{FULL}-router:8000", "--model", "smollm2-135m-instruct"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # The arguments are ones `pdserve bench serve` accepts (parsed by the real command, not run).
    from pdserve.loadtest.cli import bench

    serve = bench.commands["serve"]
    ctx = serve.make_context("serve", c["args"][2:])
    assert ctx.params["base_url"] == f"http://{FULL}-router:8000" and ctx.params["num_prompts"] == 200


def test_ingress_and_httproute_point_at_the_router(chart):
    ing = by_kind(render_docs(chart, load_values("planner")), "Ingress")[f"{FULL}-router"]
    path = ing["spec"]["rules"][0]["http"]["paths"][0]
    assert path["backend"]["service"] == {"name": f"{FULL}-router", "port": {"name": "http"}}
    route = by_kind(render_docs(chart, load_values("external-redis")), "HTTPRoute")[f"{FULL}-router"]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": f"{FULL}-router", "port": 8000}]


def test_min_above_max_is_refused(chart):
    with pytest.raises(Exception, match="minReplicas"):
        render_docs(chart, {"autoscaling": {"mode": "hpa", "decode": {"minReplicas": 5, "maxReplicas": 2}}})
