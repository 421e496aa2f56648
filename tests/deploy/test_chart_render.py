"""helm lint and helm template on the chart's value sets; every rendered
object validates against the Kubernetes 1.30 schemas in strict mode (unknown
fields are errors)."""

from __future__ import annotations

import copy

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy.chart import (
    CHART,
    KUBE_VERSION,
    MODEL,
    VALUE_SETS,
    Manifest,
    manifests_of,
    merged,
    of_kind,
    render,
    values_for,
)

WARNING = 2
"""helm lint's severity of a warning (errors are 3)."""


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_chart_lints_clean(name: str) -> None:
    report = helm.lint(CHART, values_for(name), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= WARNING] == []


def _validate_service_monitor(monitor: Manifest, services: list[Manifest]) -> None:
    """The prometheus-operator CRD ships no schema in kubernetes-validate, so
    its shape is checked here: the fields we set, and a port every selected
    Service has. The release's monitor selects routers and schedulers (port
    `metrics`), the gateway's its Service (`/metrics` of port `http`)."""
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    selector = monitor["spec"]["selector"]
    selected = {k: {v} for k, v in selector.get("matchLabels", {}).items()}
    selected |= {expr["key"]: set(expr["values"]) for expr in selector.get("matchExpressions", [])}
    matching = [
        s for s in services if all(s["metadata"]["labels"].get(k) in v for k, v in selected.items())
    ]
    components = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in matching}
    gateway = monitor["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    assert components == ({"gateway"} if gateway else {"router", "scheduler"})
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) == ({"port", "path", "interval"} if gateway else {"port", "interval"})
        for service in matching:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid_kubernetes_1_30(name: str) -> None:
    objects = manifests_of(name)
    assert objects
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            _validate_service_monitor(obj, of_kind(objects, "Service"))
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    """So the check above means something: a misspelt field is an error."""
    service = copy.deepcopy(of_kind(manifests_of("defaults"), "Service")[0])
    service["spec"]["clusterIp"] = "None"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBE_VERSION, strict=True)


def test_the_service_monitor_is_off_by_default() -> None:
    assert of_kind(manifests_of("defaults"), "ServiceMonitor") == []


def test_replica_counts_are_independent_per_tier() -> None:
    objects = manifests_of("scaled")
    replicas = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["replicas"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    assert replicas == {"router": 3, "scheduler": 4, "executor": 8, "redis": 1, "gateway": 2}


def test_an_external_redis_renders_no_redis_of_ours() -> None:
    objects = manifests_of("external-redis")
    components = {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in objects}
    assert "redis" not in components


def test_notes_say_where_clients_connect() -> None:
    notes = render(values_for("tls"))["pagedkv/templates/NOTES.txt"]
    assert "demo-pagedkv-router.llm.svc:50051" in notes
    assert "client-token" in notes
    assert "pagedkv stats --target localhost:50051 --tls-ca ca.crt --token-file token" in notes
    assert "http://demo-pagedkv-gateway.llm.svc:8000/v1" in notes
    assert 'curl http://localhost:8000/v1/models -H "Authorization: Bearer $(cat token)"' in notes


def test_notes_name_the_gateway_api_keys_secret() -> None:
    notes = render(values_for("tls-existing-secrets"))["pagedkv/templates/NOTES.txt"]
    assert "API_KEY: one line of keys.txt in Secret api-keys." in notes
    without = render(values_for("defaults"))["pagedkv/templates/NOTES.txt"]
    assert "demo-pagedkv-gateway" not in without


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"name": ""}}, "model.name is required"),
        (
            {"model": {"hostPath": {"path": "/mnt/models"}}},
            "not both",
        ),
        (
            {"model": {"persistentVolumeClaim": {"claimName": ""}}},
            "set model.persistentVolumeClaim.claimName or model.hostPath.path",
        ),
        ({"redis": {"enabled": False}}, "redis.url is required"),
        ({"redis": {"url": "redis://elsewhere:6379/0"}}, "set redis.enabled=false"),
        (
            {"redis": {"enabled": False, "url": "redis://r:6379/0"}},
            "redis.auth.existingSecret is required",
        ),
        ({"tls": {"generate": True}}, "set tls.enabled=true too"),
        ({"tls": {"enabled": True}}, "tls.existingSecrets.scheduler is required"),
        (
            {
                "tls": {
                    "enabled": True,
                    "existingSecrets": {"router": "r", "scheduler": "s", "executor": "e"},
                },
                "gateway": {"enabled": True},
            },
            "tls.existingSecrets.gateway is required",
        ),
        (
            {"model": {"hubCache": True, "mountOnSchedulers": True}},
            "model.mountOnSchedulers needs a model directory",
        ),
    ],
)
def test_inconsistent_values_fail_with_a_clear_message(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(merged(MODEL, values))
