"""The services' own settings objects read what the chart gives each tier (ConfigMap + container env).

Oracle: the pydantic-settings classes the services use (RouterSettings, RegistrySettings, WorkerSettings,
PlannerSettings), fed exactly the environment Kubernetes would build from the rendered manifests.
"""

from __future__ import annotations

import base64

import pytest

from chart_render import RELEASE, by_kind, load_values, pod_template, render_docs

FULL = f"{RELEASE}-pdserve"


def pod_environment(docs, tier: str) -> dict[str, str]:
    """The environment of ``tier``'s container as the kubelet would build it (fieldRefs given fixed values)."""
    (c,) = pod_template(docs, f"{FULL}-{tier}")["spec"]["containers"]
    configmaps = by_kind(docs, "ConfigMap")
    secrets = by_kind(docs, "Secret")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env |= configmaps[src["configMapRef"]["name"]]["data"]
    fields = {"metadata.name": f"{FULL}-{tier}-abc12", "metadata.namespace": "llm", "status.podIP": "10.1.2.3"}
    for e in c["env"]:
        if "value" in e:
            value = e["value"]
            for name, known in env.items():  # $(VAR) expansion from earlier entries
                value = value.replace(f"$({name})", known)
            env[e["name"]] = value
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
    return env


@pytest.fixture
def gpu_docs(chart):
    return render_docs(chart, load_values("gpu") | {"secrets": {"apiKeys": ["sk-1", "sk-2"], "kvTransferSecret": "s3"}})


@pytest.mark.parametrize("tier", ["prefill", "decode"])
def test_workers_get_the_engine_settings_and_their_identity(gpu_docs, monkeypatch, tier):
    from pdserve.shared.worker.settings import WorkerSettings

    for k, v in pod_environment(gpu_docs, tier).items():
        monkeypatch.setenv(k, v)
    s = WorkerSettings()
    assert (s.model, s.dtype, s.block_size, s.max_model_len, s.max_num_seqs, s.max_num_batched_tokens) == (
        "/models/Llama-3.1-8B-Instruct", "bfloat16", 16, 8192, 256, 8192)
    assert (s.enable_prefix_caching, s.kv_cache_memory, s.device, s.attention_backend) == (True, "40GiB", "cuda", "triton")
    assert s.advertise_host == "10.1.2.3" and s.pod_id == f"{FULL}-{tier}-abc12"
    assert s.port == {"prefill": 8002, "decode": 8003}[tier]
    assert s.kv_transfer_secret == "s3"
    # the in-chart Redis wants a password by default: generated (48 characters), from the chart's Secret
    password = s.redis_url.removeprefix("redis://:").removesuffix(f"@{FULL}-redis:6379/0")
    assert len(password) == 48 and s.redis_url == f"redis://:{password}@{FULL}-redis:6379/0"
    assert s.registry_url == f"http://{FULL}-registry:8001"


def test_router_gets_keys_model_name_and_routing(gpu_docs, monkeypatch):
    from pdserve.services.router.settings import RouterSettings

    for k, v in pod_environment(gpu_docs, "router").items():
        monkeypatch.setenv(k, v)
    s = RouterSettings()
    assert s.api_keys == ["sk-1", "sk-2"]
    assert s.served_name == "llama-3.1-8b-instruct"
    assert (s.port, s.local_prefill_threshold, s.max_model_len) == (8000, 128, 8192)
    # the prefill policy's inputs: the chart's routing values, and the decode pods' own step budget
    assert (s.pd_policy, s.ttft_slo_ms, s.tpot_slo_ms, s.prefill_tokens_per_s, s.max_num_batched_tokens) == (
        "queue-aware", 2000, 100, 1000, 8192)
    assert s.registry_url == f"http://{FULL}-registry:8001"


def test_registry_gets_redis_with_a_password(chart, monkeypatch):
    from pdserve.services.registry.settings import RegistrySettings

    docs = render_docs(chart, load_values("keda"))  # in-chart Redis with auth
    for k, v in pod_environment(docs, "registry").items():
        monkeypatch.setenv(k, v)
    s = RegistrySettings()
    assert (s.port, s.redis_url) == (8001, f"redis://:change-me@{FULL}-redis:6379/0")


def test_planner_gets_its_deployments_and_objectives(chart, monkeypatch):
    from pdserve.services.planner.settings import PlannerSettings

    docs = render_docs(chart, load_values("planner"))
    for k, v in pod_environment(docs, "planner").items():
        monkeypatch.setenv(k, v)
    s = PlannerSettings()
    assert (s.namespace, s.prefill_deployment, s.decode_deployment, s.router_deployment) == (
        "llm", f"{FULL}-prefill", f"{FULL}-decode", f"{FULL}-router")
    assert (s.port, s.interval_seconds, s.ttft_slo_seconds, s.tpot_slo_seconds) == (8004, 10, 1.5, 0.08)
    assert (s.prefill_max_replicas, s.decode_max_replicas, s.manual_override_backoff_seconds) == (6, 6, 600)


def test_decode_tier_gets_the_speculative_config(chart, monkeypatch):
    from pdserve.shared.engine.spec_decode.config import SpeculativeConfig
    from pdserve.shared.worker.settings import WorkerSettings

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    docs = render_docs(chart, {"decode": {"speculativeConfig": spec}})
    assert "PDSERVE_SPECULATIVE_CONFIG" not in pod_environment(docs, "prefill")
    for k, v in pod_environment(docs, "decode").items():
        monkeypatch.setenv(k, v)
    config = WorkerSettings().engine_config().speculative_config
    assert config == SpeculativeConfig.from_dict(spec)
    assert "PDSERVE_SPECULATIVE_CONFIG" not in pod_environment(render_docs(chart, {}), "decode")


@pytest.mark.parametrize("claim", ["", "kv-tier-claim"])
def test_kv_offloading_values_give_prefill_and_decode_engines_their_tiers_and_a_volume(chart, monkeypatch, claim):
    """engine.kvOffloading reaches both worker tiers' engines (CPU GiB, store threshold, disk path and GiB; each pod's own directory
    under the mount) and mounts the disk tier's volume there: an emptyDir sized to the tier, or the claim given."""
    from pdserve.services.decode.settings import DecodeSettings
    from pdserve.services.prefill.settings import PrefillSettings

    values = {"engine": {"kvOffloading": {"cpuSize": 4, "storeThreshold": 2, "disk": {"enabled": True, "size": 2,
                                                                  "existingClaim": claim}}}}
    docs = render_docs(chart, values)
    for tier, settings_class in (("prefill", PrefillSettings), ("decode", DecodeSettings)):
        for k, v in pod_environment(docs, tier).items():
            monkeypatch.setenv(k, v)
        config = settings_class().engine_config()
        assert (config.kv_offloading_size, config.kv_offloading_disk_size) == (4.0, 2.0)
        assert config.kv_offloading_store_threshold == 2
        assert config.kv_offloading_disk_path == f"/var/cache/pdserve-kv/{FULL}-{tier}-abc12"
        spec = pod_template(docs, f"{FULL}-{tier}")["spec"]
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "kv-offload"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "kv-offload"]
        assert mount["mountPath"] == "/var/cache/pdserve-kv"
        assert volume == ({"name": "kv-offload", "persistentVolumeClaim": {"claimName": claim}} if claim else
                          {"name": "kv-offload", "emptyDir": {"sizeLimit": "2112Mi"}})
    for tier in ("router", "registry"):
        assert "kv-offload" not in {v["name"] for v in pod_template(docs, f"{FULL}-{tier}")["spec"]["volumes"]}


def test_the_default_chart_has_no_kv_offloading_tiers(chart):
    docs = render_docs(chart)
    env = pod_environment(docs, "decode")
    assert not {"PDSERVE_KV_OFFLOADING_SIZE", "PDSERVE_KV_OFFLOADING_DISK_PATH"} & set(env)
    assert "kv-offload" not in {v["name"] for v in pod_template(docs, f"{FULL}-decode")["spec"]["volumes"]}
