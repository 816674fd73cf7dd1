"""Every metric is declared once, in its service's table, and documented: docs/metrics.md "Every metric" is the
table rendered (pdserve/services/metric_docs.py), so a metric added without its documentation fails here."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from pdserve.services import metric_docs
from pdserve.shared.engine.kv_offload import TierStats
from pdserve.shared.engine.stats import EngineStats
from pdserve.shared.metric_table import build
from pdserve.shared.worker.metrics import METRICS as WORKER_METRICS
from pdserve.shared.worker.metrics import WorkerMetrics


def test_docs_every_metric_section_is_the_rendered_tables():
    text = metric_docs.DOC.read_text()
    assert metric_docs.rewrite(text) == text, "docs/metrics.md is stale: run python -m pdserve.services.metric_docs"


def test_every_documented_name_is_mentioned_once_per_table_row():
    text = metric_docs.DOC.read_text()
    for name in metric_docs.exposed_names():
        assert f"| `{name}` |" in text


def test_each_service_table_builds_in_one_registry_per_role():
    # a duplicate name within what one process exports would raise here (prometheus_client refuses it)
    for service, table in metric_docs.tables().items():
        for role in ("prefill", "decode") if service == "prefill/decode" else (None,):
            base = {"role": role, "pod": "p"} if role else {}
            assert build(table, CollectorRegistry(), base, role)


def test_worker_rows_follow_fields_that_exist():
    # a misspelled stat would be an AttributeError on the first snapshot of a serving pod: caught here instead
    engine_fields = {f.name for f in dataclasses.fields(EngineStats)}
    tier_fields = {f.name for f in dataclasses.fields(TierStats)}
    for row in WORKER_METRICS:
        if row.stat is not None:
            assert row.stat in (tier_fields if "tier" in row.labels else engine_fields), row


def test_worker_metrics_follow_a_snapshot_and_a_misspelled_stat_is_an_error():
    m = WorkerMetrics("decode", "d0")
    m.update_from_stats(EngineStats(num_running=3, prefix_cache_queries=20, prefix_cache_hits=10,
                                    prefix_cache_transfer_queries=8, prefix_cache_transfer_hits=4,
                                    offload={"cpu": TierStats(hit_tokens=5, blocks_total=7)}))
    text = m.render().decode()
    assert 'pdserve:num_requests_running{pod="d0",role="decode"} 3.0' in text
    assert 'pdserve:prefix_cache_queries_total{pod="d0",role="decode"} 12.0' in text  # new requests' lookups only
    assert 'pdserve:kv_transfer_prefix_cache_hits_total{pod="d0",role="decode"} 4.0' in text
    assert 'pdserve:kv_offload_hit_tokens_total{pod="d0",role="decode",tier="cpu"} 5.0' in text
    with pytest.raises(AttributeError):
        EngineStats().num_runing  # noqa: B018
