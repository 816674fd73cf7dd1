"""Chart: ``tensorParallelSize`` per tier sets the ranks per pod and, on cuda, the GPUs per pod."""

from __future__ import annotations

import kubernetes_validate

from chart_render import by_kind, render_docs


def _engine(deploy) -> dict:
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    return {"tp": env["PDSERVE_TENSOR_PARALLEL_SIZE"],
            "gpus": container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")}


def test_tensor_parallel_size_sets_ranks_and_gpus_per_pod(chart):
    docs = render_docs(chart, {"engine": {"device": "cuda"}, "decode": {"tensorParallelSize": 4,
                               "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}}}})
    deploys = by_kind(docs, "Deployment")
    assert _engine(deploys["demo-pdserve-decode"]) == {"tp": "4", "gpus": 4}
    assert _engine(deploys["demo-pdserve-prefill"]) == {"tp": "1", "gpus": None}
    assert deploys["demo-pdserve-decode"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "memory"] == "8Gi"
    kubernetes_validate.validate(deploys["demo-pdserve-decode"], "1.29", strict=True)
    # on CPU the ranks share the pod's CPUs: no GPU asked for
    cpu = by_kind(render_docs(chart, {"prefill": {"tensorParallelSize": 3}}), "Deployment")
    assert _engine(cpu["demo-pdserve-prefill"]) == {"tp": "3", "gpus": None}
