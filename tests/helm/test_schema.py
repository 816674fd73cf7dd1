"""values.schema.json: Helm refuses bad values before rendering anything."""

from __future__ import annotations

import pytest

from chart_render import VALUES_FILES, helm, load_values


@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_shipped_values_files_pass_the_schema(chart, case):
    chart.validate_schema(chart.merge_values(load_values(case)))


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"prefill": {"replicaCount": -1}}, "/prefill/replicaCount"),
        ({"decode": {"replicaCount": -3}}, "/decode/replicaCount"),
        ({"autoscaling": {"mode": "magic"}}, "/autoscaling/mode"),
        ({"autoscaling": {"mode": "HPA"}}, "/autoscaling/mode"),
        ({"autoscaling": {"decode": {"targetKvCacheUsage": 1.5}}}, "/autoscaling/decode/targetKvCacheUsage"),
        ({"autoscaling": {"prefill": {"maxReplicas": 0}}}, "/autoscaling/prefill/maxReplicas"),
        ({"engine": {"blockSize": 12}}, "/engine/blockSize"),
        ({"model": {"dtype": "fp8"}}, "/model/dtype"),
        ({"router": {"port": 70000}}, "/router/port"),
        ({"redis": {"external": {"url": "http://redis:6379"}}}, "/redis/external/url"),
        ({"redis": {"external": {"url": "redis+swarm://redis:6379"}}}, "/redis/external/url"),
        ({"routing": {"localPrefillTreshold": 3}}, "/routing"),
        ({"secrets": {"apiKeys": ["a,b"]}}, "/secrets/apiKeys/0"),
    ],
)
def test_schema_rejects_bad_values_naming_the_key(chart, values, where):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name="demo", namespace="llm")
    assert where in str(err.value), str(err.value)
