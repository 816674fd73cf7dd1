"""Our JSON Schema of a ``leaderworkerset.x-k8s.io/v1`` LeaderWorkerSet, for validating the chart's rendering.

The LWS CRD cannot be fetched on this machine (no network), so this is written here from the CRD's Go types,
``kubernetes-sigs/lws`` ``api/leaderworkerset/v1/leaderworkerset_types.go`` (LeaderWorkerSetSpec,
LeaderWorkerTemplate, RolloutStrategy, RollingUpdateConfiguration, SubGroupPolicy, NetworkConfig): each field's
JSON name, its type (``*int32`` -> integer within int32, ``intstr.IntOrString`` -> integer or string), what is
required (no ``omitempty``/``+optional``: ``leaderWorkerTemplate``, ``workerTemplate``, ``rolloutStrategy.type``)
and the ``+kubebuilder:validation:Enum`` lists. ``size >= 1`` is from the field's documentation ("The minimum is
1 which represent the leader"), checked by LWS's webhook. As in the generated CRD (a structural schema, no
unknown fields kept), every LWS-level object refuses unknown fields.

The two pod templates are ``core/v1 PodTemplateSpec`` in the CRD; this schema leaves them open and
``validate_leaderworkerset`` validates each strictly against Kubernetes' own OpenAPI schema (kubernetes-validate,
as a v1 PodTemplate), the same schema the CRD embeds.
"""

from __future__ import annotations

import jsonschema
import kubernetes_validate

INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
POD_TEMPLATE_SPEC = {"type": "object"}  # core/v1 PodTemplateSpec: validated by kubernetes-validate below


def _obj(props: dict, required: tuple = ()) -> dict:
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = list(required)
    return out


LEADER_WORKER_TEMPLATE = _obj({
    "leaderTemplate": POD_TEMPLATE_SPEC,
    "workerTemplate": POD_TEMPLATE_SPEC,
    "size": {**INT32, "minimum": 1},
    "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
    "subGroupPolicy": _obj({"subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                            "subGroupSize": {**INT32, "minimum": 1}}),
    "volumeClaimTemplates": {"type": "array", "items": {"type": "object"}},
    "persistentVolumeClaimRetentionPolicy": _obj({"whenDeleted": {"type": "string"}, "whenScaled": {"type": "string"}}),
}, required=("workerTemplate",))

SPEC = _obj({
    "replicas": {**INT32, "minimum": 0},
    "leaderWorkerTemplate": LEADER_WORKER_TEMPLATE,
    "rolloutStrategy": _obj({
        "type": {"enum": ["RollingUpdate"]},
        "rollingUpdateConfiguration": _obj({"partition": {**INT32, "minimum": 0}, "maxUnavailable": INT_OR_STRING,
                                            "maxSurge": INT_OR_STRING}),
    }, required=("type",)),
    "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
    "networkConfig": _obj({"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}),
}, required=("leaderWorkerTemplate",))

LEADER_WORKER_SET = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": SPEC,
    },
    "additionalProperties": False,
}


def validate_leaderworkerset(doc: dict, kube_version: str = "1.29") -> list[str]:
    """Every problem of ``doc`` as a LeaderWorkerSet (empty: valid): our schema of the LWS fields, then each pod
    template against Kubernetes' PodTemplateSpec schema (strict: unknown fields are errors)."""
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
              for e in jsonschema.Draft202012Validator(LEADER_WORKER_SET).iter_errors(doc)]
    lwt = (doc.get("spec") or {}).get("leaderWorkerTemplate") or {}
    for key in ("leaderTemplate", "workerTemplate"):
        if key in lwt:
            as_pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                               "metadata": {"name": f"{doc['metadata']['name']}-{key}"}, "template": lwt[key]}
            try:
                kubernetes_validate.validate(as_pod_template, kube_version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"spec.leaderWorkerTemplate.{key}: {e.message} at {list(e.path)}")
    return errors
