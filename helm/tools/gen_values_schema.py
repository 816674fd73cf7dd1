"""Writes helm/pdserve/values.schema.json, the JSON Schema Helm checks every install's values against.

The schema is kept in git; rerun this after changing the shape of values.yaml
(`python helm/tools/gen_values_schema.py`). tests/helm checks that the committed file is current.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "pdserve" / "values.schema.json"

def obj(props, required=None, extra=False, **kw):
    d = {"type": "object", "properties": props, "additionalProperties": extra}
    if required:
        d["required"] = required
    d.update(kw)
    return d

S = {"type": "string"}
B = {"type": "boolean"}
I0 = {"type": "integer", "minimum": 0}
I1 = {"type": "integer", "minimum": 1}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
MAP = {"type": "object"}
STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
LIST = {"type": "array"}
ENV = {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {"name": S}}}
QTY = {"anyOf": [{"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([eE][0-9]+|[KMGTPE]i?|m|k)?$"}, {"type": "number", "minimum": 0}]}
RES = obj({"requests": {"type": "object", "additionalProperties": QTY},
           "limits": {"type": "object", "additionalProperties": QTY},
           "claims": LIST})
PDB = obj({"enabled": B,
           "maxUnavailable": {"anyOf": [I0, {"type": "string", "pattern": r"^[0-9]+%$"}]},
           "minAvailable": {"anyOf": [I0, {"type": "string", "pattern": r"^[0-9]+%$"}]}},
          required=["enabled"])
TTFT_BUCKET_BOUNDS = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0",
                      "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0"]
ITL_BUCKET_BOUNDS = ["0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0", "2.5",
                     "5.0", "7.5", "10.0", "20.0", "40.0", "80.0"]
SHM = obj({"enabled": B, "sizeLimit": QTY})


def speculative_config_schema() -> dict:
    """vLLM's speculative_config dict for decode pods ({} = off; docs/engine.md): one property per field of the
    engine's ``SpeculativeConfig``, so a field added there is accepted by the chart without a second list here.
    Its validation is the types' bounds: every integer is >= 1, ``method`` one of ``METHODS``."""
    import typing
    from dataclasses import fields

    from pdserve.shared.engine.spec_decode.config import METHODS, SpeculativeConfig

    hints = typing.get_type_hints(SpeculativeConfig)
    by_type = {int: I1, str: S, bool: B, float: {"type": "number"}}
    props = {}
    for f in fields(SpeculativeConfig):
        kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        assert len(kinds) == 1 and kinds[0] in by_type, f"SpeculativeConfig.{f.name}: no schema for {hints[f.name]}"
        props[f.name] = {"enum": list(METHODS)} if f.name == "method" else by_type[kinds[0]]
    return obj(props, description="vLLM's speculative_config for decode pods ({} = off)")


SPEC = speculative_config_schema()


def kv_transfer_config_schema() -> dict:
    """vLLM's kv_transfer_config for prefill and decode pods ({} = tcp): the fields ``KVTransferConfig`` reads, the
    connectors ``KVConnectorFactory`` registers but ``loopback`` (in-process, for tests), vLLM's ``kv_role``s."""
    from pdserve.shared.transport.connector import KV_ROLES, KVConnectorFactory

    return obj({"kv_connector": {"enum": [n for n in KVConnectorFactory.names() if n != "loopback"]},
                "kv_role": {"enum": list(KV_ROLES)}, "kv_connector_extra_config": {"type": "object"}},
               description="vLLM's kv_transfer_config for prefill and decode pods (--kv-transfer-config); {} = tcp")

def tier(extra_props=None, replicas=True, pdb=True, gpu=False):
    p = {
        "port": PORT,
        "resources": {"$ref": "#/$defs/resources"},
        "nodeSelector": STRMAP,
        "tolerations": LIST,
        "affinity": MAP,
        "podAnnotations": STRMAP,
        "podLabels": STRMAP,
        "env": {"$ref": "#/$defs/env"},
        "terminationGracePeriodSeconds": I0,
    }
    req = ["port", "resources"]
    if replicas:
        p["replicaCount"] = I0
        req.append("replicaCount")
    if pdb:
        p["pdb"] = {"$ref": "#/$defs/pdb"}
    if gpu:
        p["runtimeClassName"] = S
        p["shm"] = {"$ref": "#/$defs/shm"}
    p.update(extra_props or {})
    return obj(p, required=req)

def scaled_tier(props):
    base = {"minReplicas": I0, "maxReplicas": I1,
            "scaleUpStabilizationSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
            "scaleDownStabilizationSeconds": {"type": "integer", "minimum": 0, "maximum": 3600}}
    base.update(props)
    return obj(base, required=["minReplicas", "maxReplicas"])

# NetworkPolicyPeer / NetworkPolicyEgressRule, shaped as the Kubernetes API has them (an empty peer is invalid there).
SELECTOR = obj({"matchLabels": STRMAP, "matchExpressions": LIST})
PEER = obj({"podSelector": SELECTOR, "namespaceSelector": SELECTOR,
            "ipBlock": obj({"cidr": {"type": "string", "minLength": 1}, "except": {"type": "array", "items": S}}, required=["cidr"])},
           minProperties=1)
PEERS = {"type": "array", "items": {"$ref": "#/$defs/networkPolicyPeer"}}
NP_PORT = obj({"protocol": {"enum": ["TCP", "UDP", "SCTP"]}, "port": {"anyOf": [PORT, {"type": "string", "minLength": 1}]},
               "endPort": PORT})
EGRESS_RULE = obj({"to": PEERS, "ports": {"type": "array", "items": NP_PORT}})

POS = {"type": "number", "exclusiveMinimum": 0}
FRAC = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
# <tier>.multiNode: a LeaderWorkerSet group of `nodes` pods per replica (nodes must divide tensorParallelSize:
# the templates fail on that, JSON Schema cannot say it)
MULTI_NODE = obj({"enabled": B, "nodes": {"type": "integer", "minimum": 2}, "masterPort": PORT,
                  "joinTimeoutSeconds": POS})

schema = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "pdserve chart values",
    "$defs": {"resources": RES, "env": ENV, "pdb": PDB, "shm": SHM, "networkPolicyPeer": PEER, "multiNode": MULTI_NODE},
    **obj({
        "global": MAP,
        "nameOverride": S,
        "fullnameOverride": S,
        "image": obj({"repository": {"type": "string", "minLength": 1}, "tag": S,
                      "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}, required=["repository"]),
        "imagePullSecrets": LIST,
        "commonLabels": STRMAP,
        "model": obj({
            "name": {"type": "string", "minLength": 1},
            "uri": S,
            "dtype": {"enum": ["float32", "bfloat16", "float16"]},
            "volume": obj({"enabled": B, "mountPath": {"type": "string", "pattern": "^/"}, "existingClaim": S}),
        }, required=["name"]),
        "engine": obj({
            "blockSize": {"type": "integer", "enum": [1, 2, 4, 8, 16, 32, 64, 128, 256]},
            "maxModelLen": I1,
            "maxNumSeqs": I1,
            "maxNumBatchedTokens": I1,
            "enablePrefixCaching": B,
            "device": {"enum": ["cpu", "cuda"]},
            "attentionBackend": {"enum": ["auto", "cpu", "torch", "triton"]},
            "preemptionMode": {"enum": ["recompute", "swap"]},
            "kvCacheMemory": {"anyOf": [{"type": "integer", "minimum": 1},
                                         {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?\s*([KMGT]i?B?|B)?$"}]},
            # KV offloading tiers (GiB; docs/engine.md "KV offloading tiers")
            "kvOffloading": obj({"cpuSize": {"type": "number", "minimum": 0},
                                 "storeThreshold": {"type": "integer", "minimum": 1},
                                 "disk": obj({"enabled": B, "size": {"type": "number", "exclusiveMinimum": 0},
                                              "mountPath": {"type": "string", "pattern": "^/"},
                                              "existingClaim": S})}),
        }, required=["blockSize", "maxModelLen", "maxNumSeqs", "maxNumBatchedTokens"]),
        "routing": obj({"localPrefillThreshold": I0, "pdPolicy": {"enum": ["queue-aware", "threshold"]},
                        "ttftSloMs": {"type": "number", "minimum": 0}, "tpotSloMs": {"type": "number", "minimum": 0},
                        "prefillTokensPerS": POS}),
        "logLevel": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "debug", "info", "warning", "error", "critical"]},
        "extraEnv": {"$ref": "#/$defs/env"},
        "kvTransferConfig": kv_transfer_config_schema(),
        "secrets": obj({"apiKeys": {"type": "array", "items": {"type": "string", "minLength": 1, "pattern": "^[^,]+$"}},
                        "kvTransferSecret": S,
                        # sent in an HTTP header: visible ASCII, no spaces (empty: generated)
                        "registryToken": {"type": "string", "pattern": "^[!-~]*$"},
                        "existingSecret": S, "apiKeysKey": S,
                        "kvTransferSecretKey": S, "registryTokenKey": S, "loadtestApiKeyKey": S}),
        "redis": obj({
            "enabled": B,
            "image": obj({"repository": S, "tag": S, "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}),
            "appendfsync": {"enum": ["always", "everysec", "no"]},
            "maxmemoryPolicy": {"enum": ["noeviction", "allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-lfu",
                                         "allkeys-random", "volatile-random", "volatile-ttl"]},
            "auth": obj({"enabled": B, "password": S, "existingSecret": S, "existingSecretPasswordKey": S}),
            "persistence": obj({"enabled": B, "size": QTY, "storageClass": S,
                                "accessModes": {"type": "array", "items": {"enum": ["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"]}}}),
            "resources": {"$ref": "#/$defs/resources"},
            "nodeSelector": STRMAP, "tolerations": LIST, "affinity": MAP, "podAnnotations": STRMAP,
            "external": obj({"url": {"type": "string", "pattern": r"^(|(rediss?|unix|rediss?\+cluster|rediss?\+sentinel)://.+)$"}, "existingSecret": S, "existingSecretKey": S}),
        }, required=["enabled"]),
        "podSecurityContext": MAP,
        "securityContext": MAP,
        "serviceAccount": obj({"create": B, "name": S, "annotations": STRMAP}),
        "probes": obj({k: obj({"periodSeconds": I1, "failureThreshold": I1, "timeoutSeconds": I1}) for k in ("startup", "readiness", "liveness")}),
        "router": tier({"service": obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "port": PORT, "annotations": STRMAP}),
                        "shutdownGraceSeconds": {"type": "number", "minimum": 0}, "preStopSleepSeconds": I0}),
        "registry": tier(),
        "prefill": tier({"tensorParallelSize": I1, "multiNode": {"$ref": "#/$defs/multiNode"}}, gpu=True),
        "decode": tier({"kvPort": PORT, "speculativeConfig": SPEC, "tensorParallelSize": I1,
                        "multiNode": {"$ref": "#/$defs/multiNode"}}, gpu=True),
        "planner": tier({"intervalSeconds": I1, "dryRun": B}, replicas=False, pdb=False),
        "autoscaling": obj({
            "mode": {"enum": ["none", "hpa", "keda", "planner"]},
            "prefill": scaled_tier({"targetQueueTokensPerReplica": I1, "targetLagPerReplica": I1,
                                    "ttftSloSeconds": POS, "throughputPriorTokensPerSecond": POS}),
            "decode": scaled_tier({"targetKvCacheUsage": FRAC, "tpotSloSeconds": POS}),
            "hpa": obj({"prefillQueueMetric": {"type": "string", "minLength": 1}, "prefillQueueMetricSelector": MAP,
                        "decodeKvUsageMetric": {"type": "string", "minLength": 1}}),
            "keda": obj({"pollingInterval": I1, "cooldownPeriod": I0, "redisAddress": S,
                         "redisPasswordSecret": obj({"name": S, "key": S}),
                         "prometheus": obj({"serverAddress": S, "query": S})}),
            "planner": obj({"scaleUpCooldownSeconds": I0, "manualOverrideBackoffSeconds": I0}),
        }, required=["mode"]),
        "ingress": obj({"enabled": B, "className": S, "annotations": STRMAP,
                        "hosts": {"type": "array", "items": obj({"host": S, "paths": {"type": "array", "items": obj({
                            "path": S, "pathType": {"enum": ["Prefix", "Exact", "ImplementationSpecific"]}})}})},
                        "tls": LIST}),
        "httpRoute": obj({"enabled": B, "annotations": STRMAP, "parentRefs": LIST, "hostnames": {"type": "array", "items": S},
                          "path": {"type": "string", "pattern": "^/"}}),
        "networkPolicy": obj({
            "enabled": B,
            "router": obj({"ingressFrom": PEERS}),
            "metrics": obj({"allow": {"enum": ["auto", True, False]}, "from": PEERS}),
            "keda": obj({"from": PEERS}),
            "allowExternalEgress": B,
            "extraEgress": {"type": "array", "items": EGRESS_RULE},
            "rankPorts": obj({"start": PORT, "end": PORT}, required=["start", "end"]),
        }, required=["enabled"]),
        "serviceMonitor": obj({"enabled": B, "interval": S, "scrapeTimeout": S, "labels": STRMAP}),
        "grafanaDashboard": obj({"enabled": B, "labels": STRMAP, "annotations": STRMAP}),
        "prometheusRule": obj({
            "enabled": B, "labels": STRMAP, "runbookBaseUrl": {"type": "string", "pattern": r"^(https?://.*/)?$"},
            # An SLO threshold is a bucket bound of the router's histogram, written as prometheus_client writes
            # `le` (tests/helm/test_observability.py checks these against pdserve/services/router/metrics.py).
            "slo": obj({"ttftSeconds": {"enum": TTFT_BUCKET_BOUNDS}, "tpotSeconds": {"enum": ITL_BUCKET_BOUNDS},
                        "objective": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
                       required=["ttftSeconds", "tpotSeconds", "objective"]),
            "kvCacheUsageThreshold": {"type": "number", "minimum": 0, "maximum": 1},
            "queueDepthThreshold": I0, "flappingDeregistrations": I0}),
        "loadtest": obj({"enabled": B, "args": {"type": "array", "items": S}, "backoffLimit": I0,
                         "ttlSecondsAfterFinished": I0, "resources": {"$ref": "#/$defs/resources"},
                         "nodeSelector": STRMAP, "tolerations": LIST}),
    }, required=["image", "model", "engine", "redis", "router", "registry", "prefill", "decode", "autoscaling"]),
}


def render() -> str:
    """The schema document as written to disk."""
    # min <= max cannot be said in JSON Schema; the templates fail on it instead.
    return json.dumps(schema, indent=2) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else SCHEMA_PATH
    out.write_text(render())
    print(f"wrote {out}")
