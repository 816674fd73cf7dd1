"""Chart: ``kvTransferConfig`` reaches prefill and decode pods as ``--kv-transfer-config`` (vLLM's flag shape).

Oracle: the prefill and decode commands themselves (their click parsers and settings) read the rendered
container args, and ``KVTransferConfig.parse`` the JSON; the schema refuses a connector the chart cannot run.
"""

from __future__ import annotations

import pytest

from chart_render import RELEASE, helm, load_values, pod_template, pod_templates, render_docs

from pdserve.shared.transport.connector import KVTransferConfig

FULL = f"{RELEASE}-pdserve"


def container_args(docs, tier: str) -> list[str]:
    (c,) = pod_template(docs, f"{FULL}-{tier}")["spec"]["containers"]
    return c["args"]


def test_without_kv_transfer_config_the_tiers_run_plain_tcp(chart):
    docs = render_docs(chart)
    assert container_args(docs, "prefill") == ["prefill"] and container_args(docs, "decode") == ["decode"]


@pytest.mark.parametrize("tier", ["prefill", "decode"])
def test_kv_transfer_config_is_the_flag_both_tiers_parse(chart, tier):
    import click

    from pdserve.services.cli import main

    config = {"kv_connector": "shm", "kv_connector_extra_config": {"note": "same node"}}
    args = container_args(render_docs(chart, {"kvTransferConfig": config}), tier)
    assert args[:2] == [tier, "--kv-transfer-config"]
    assert KVTransferConfig.parse(args[2]) == KVTransferConfig(**config)
    command = main.get_command(click.Context(main), tier)
    ctx = command.make_context(tier, args[1:])
    assert KVTransferConfig.parse(ctx.params["kv_transfer_config"]).kv_connector == "shm"


def test_multinode_leader_gets_the_flag_and_rank_workers_do_not(chart):
    # the rank workers take their orders from the leader's engine; only the leader hands KV over
    values = {**load_values("multinode"), "kvTransferConfig": {"kv_connector": "tcp"}}
    docs = render_docs(chart, values)
    [lws] = [d for d in docs if d["kind"] == "LeaderWorkerSet" and d["metadata"]["name"] == f"{FULL}-decode"]
    templates = pod_templates(lws)
    (leader,) = templates["leader"]["spec"]["containers"]
    (worker,) = templates["worker"]["spec"]["containers"]
    assert leader["args"] == ["decode", "--kv-transfer-config", '{"kv_connector":"tcp"}']
    assert worker["args"][0] == "tp-worker" and "--kv-transfer-config" not in worker["args"]


def test_schema_refuses_the_in_process_loopback_connector(chart):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render({"kvTransferConfig": {"kv_connector": "loopback"}}, name=RELEASE, namespace="llm")
    assert "/kvTransferConfig/kv_connector" in str(err.value)
