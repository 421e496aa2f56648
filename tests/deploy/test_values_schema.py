"""values.schema.json: it covers every value of values.yaml, accepts the
value sets, and rejects bad values before anything renders."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.chart import CHART, MODEL, VALUE_SETS, load_values_file, merged, values_for


def _schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return loaded


def _leaf_paths(value: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if isinstance(value, dict) and value:
        return {p for k, v in value.items() for p in _leaf_paths(v, (*prefix, k))}
    return {prefix}


def _schema_has(schema: dict[str, Any], path: tuple[str, ...]) -> bool:
    node = schema
    for key in path:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        properties = node.get("properties")
        if properties is None:
            # A free-form object (resources, affinity, security contexts).
            return node.get("type") == "object" and node.get("additionalProperties") is not False
        if key not in properties:
            return False
        node = properties[key]
    return True


def test_the_schema_covers_every_value_in_values_yaml() -> None:
    schema = _schema()
    missing = [".".join(p) for p in _leaf_paths(load_values_file()) if not _schema_has(schema, p)]
    assert missing == []


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_the_value_sets_meet_the_schema(name: str) -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.merge_values(values_for(name)))


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"executor": {"gpuMemoryUtilization": 1.5}}, "/executor/gpuMemoryUtilization"),
        ({"executor": {"gpuMemoryUtilization": 0}}, "/executor/gpuMemoryUtilization"),
        ({"router": {"policy": "random"}}, "/router/policy"),
        ({"scheduler": {"replicas": -1}}, "/scheduler/replicas"),
        ({"scheduler": {"port": 70000}}, "/scheduler/port"),
        ({"executor": {"drainTimeout": "30s"}}, "/executor/drainTimeout"),
        ({"executor": {"dtype": "int8"}}, "/executor/dtype"),
        ({"redis": {"url": "http://redis:6379"}}, "/redis/url"),
        ({"executr": {"replicas": 2}}, "executr"),
        ({"tls": {"enabled": "yes"}}, "/tls/enabled"),
        ({"model": {"mountPath": "models"}}, "/model/mountPath"),
        ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval"),
        ({"gateway": {"enabled": "true"}}, "/gateway/enabled"),
        ({"gateway": {"port": 0}}, "/gateway/port"),
        ({"gateway": {"replicas": 1.5}}, "/gateway/replicas"),
        ({"gateway": {"service": {"type": "ExternalName"}}}, "/gateway/service/type"),
        ({"gateway": {"auth": {"tokensKey": ""}}}, "/gateway/auth/tokensKey"),
        ({"gateway": {"auth": {"secret": "keys"}}}, "secret"),
        ({"gateway": {"drainTimeout": -1}}, "/gateway/drainTimeout"),
        ({"gateway": {"extraArgs": "--x"}}, "/gateway/extraArgs"),
        ({"networkPolicy": {"gatewayClients": {}}}, "/networkPolicy/gatewayClients"),
    ],
)
def test_the_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(chart.merge_values(merged(MODEL, values)))


def test_the_chart_readme_documents_every_value() -> None:
    """Each value of values.yaml, or the group it belongs to, has a row in
    the README's values table."""
    readme = (CHART / "README.md").read_text()
    rows = {line.split("`")[1] for line in readme.splitlines() if line.startswith("| `")}
    undocumented = [
        ".".join(path)
        for path in _leaf_paths(load_values_file())
        if not any(".".join(path[:n]) in rows for n in range(1, len(path) + 1))
    ]
    assert undocumented == []
