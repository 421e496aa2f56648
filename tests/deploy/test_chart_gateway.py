"""The chart's HTTP gateway (`gateway.enabled`): off by default; when on, a
Deployment and a Service running `pagedkv gateway` from the scheduler image
in front of the router Service (the scheduler Service without routers),
with the model mounted, API keys and credentials towards its targets from
Secrets, HTTP probes, its own disruption budget, NetworkPolicy and
ServiceMonitor. The last test runs the rendered command line itself."""

from __future__ import annotations

import base64
import http.client
import posixpath
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chart import (
    MODEL,
    NAMESPACE,
    VALUE_SETS,
    Manifest,
    container_of,
    flag_values,
    manifests,
    manifests_of,
    merged,
    named,
    of_kind,
    values_for,
)
from tests.processes import ServedProcess

GATEWAY_SETS = sorted(name for name in VALUE_SETS if values_for(name).get("gateway"))
"""The value sets with the gateway on."""


def _component(obj: Manifest) -> str:
    component: str = obj["metadata"]["labels"]["app.kubernetes.io/component"]
    return component


def _gateway(name: str) -> tuple[Manifest, dict[str, Any], dict[str, str]]:
    """The gateway Deployment of a value set, its container and flags."""
    deployment = named(manifests_of(name), "Deployment", "gateway")
    container = container_of(deployment)
    return deployment, container, flag_values(container["args"])


def test_the_gateway_is_off_by_default() -> None:
    for name in ("defaults", "external-redis"):
        assert "gateway" not in {_component(o) for o in manifests_of(name)}


def test_the_gateway_sets_cover_router_and_scheduler_targets() -> None:
    assert {"tls", "tls-existing-secrets", "scaled", "hub-cache-no-router"} <= set(GATEWAY_SETS)


@pytest.mark.parametrize("name", GATEWAY_SETS)
def test_the_gateway_calls_the_router_service_or_the_schedulers_without_routers(
    name: str,
) -> None:
    objects = manifests_of(name)
    routers = values_for(name).get("router", {}).get("enabled", True)
    front = named(objects, "Service", "router" if routers else "scheduler")
    port = next(p["port"] for p in front["spec"]["ports"] if p["name"] == "grpc")
    _, container, flags = _gateway(name)
    assert container["args"][:3] == ["--log-format", "json", "gateway"]
    assert flags["--target"] == f"{front['metadata']['name']}.{NAMESPACE}.svc:{port}"


def test_the_target_follows_the_router_service_port() -> None:
    values = merged(values_for("tls"), {"router": {"service": {"port": 443}}})
    gateway = named(manifests(values), "Deployment", "gateway")
    assert flag_values(container_of(gateway)["args"])["--target"] == (
        f"demo-pagedkv-router.{NAMESPACE}.svc:443"
    )


@pytest.mark.parametrize("name", GATEWAY_SETS)
def test_the_gateway_runs_the_scheduler_image_without_redis_or_gpu(name: str) -> None:
    deployment, container, flags = _gateway(name)
    assert container["image"].startswith("pagedkv-scheduler:")
    assert not any(flag.startswith("--redis") for flag in container["args"])
    volumes = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "redis-password" not in volumes
    assert not any("gpu" in k for part in container["resources"].values() for k in part)
    assert flags["--host"] == "0.0.0.0"


@pytest.mark.parametrize("name", GATEWAY_SETS)
def test_probes_and_the_service_use_the_port_the_gateway_listens_on(name: str) -> None:
    objects = manifests_of(name)
    _, container, flags = _gateway(name)
    (port,) = container["ports"]
    assert port == {"name": "http", "containerPort": int(flags["--port"]), "protocol": "TCP"}
    gateway_values = values_for(name)["gateway"]
    assert port["containerPort"] == gateway_values.get("port", 8000)
    # /health is 503 while no target serves: readiness only. /metrics answers
    # from the process alone, without a token: liveness.
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    service = named(objects, "Service", "gateway")
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == "http"
    assert service_port["port"] == gateway_values.get("service", {}).get("port", 8000)
    assert service["spec"]["type"] == gateway_values.get("service", {}).get("type", "ClusterIP")
    assert (
        service["spec"]["selector"]
        == named(objects, "Deployment", "gateway")["spec"]["selector"]["matchLabels"]
    )


def test_the_model_is_mounted_and_served_under_its_name() -> None:
    deployment, container, flags = _gateway("scaled")
    assert flags["--model"] == "/models/Qwen2.5-0.5B"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == "/mnt/models"
    assert flags["--served-model-name"] == "qwen"
    # Without servedModelName, the chart's model name (not the mounted path).
    assert _gateway("tls")[2]["--served-model-name"] == "Qwen2.5-0.5B"


def test_a_hub_cache_gives_the_gateway_the_hub_id() -> None:
    _, container, flags = _gateway("hub-cache-no-router")
    assert flags["--model"] == flags["--served-model-name"] == "Qwen/Qwen2.5-0.5B-Instruct"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_CACHE"] == "/models"


def test_api_keys_come_from_their_own_secret_or_the_chart_tokens() -> None:
    # gateway.auth.existingSecret: its key, mounted as the file the flag reads.
    deployment, container, flags = _gateway("tls-existing-secrets")
    assert flags["--auth-token-file"] == "/etc/pagedkv/api-keys/tokens"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "api-keys"
    assert volumes["api-keys"]["secret"]["items"] == [{"key": "keys.txt", "path": "tokens"}]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert mount["mountPath"] == posixpath.dirname(flags["--auth-token-file"])
    # auth.enabled alone: the chart's tokens, as routers accept them.
    assert _gateway("tls")[2]["--auth-token-file"] == "/etc/pagedkv/auth/tokens"
    # Neither: no key asked.
    assert "--auth-token-file" not in _gateway("hub-cache-no-router")[1]["args"]


def test_api_keys_alone_need_no_chart_tokens() -> None:
    values = merged(MODEL, {"gateway": {"enabled": True, "auth": {"existingSecret": "keys"}}})
    gateway = named(manifests(values), "Deployment", "gateway")
    flags = flag_values(container_of(gateway)["args"])
    assert flags["--auth-token-file"] == "/etc/pagedkv/api-keys/tokens"
    assert "--token-file" not in flags
    volumes = {v["name"] for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert "auth" not in volumes


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("tls", {"--tls-ca", "--token-file"}),
        ("tls-existing-secrets", {"--tls-ca", "--tls-cert", "--tls-key", "--token-file"}),
        ("scaled", set()),
    ],
)
def test_the_gateway_presents_the_credentials_the_routers_present(
    name: str, expected: set[str]
) -> None:
    """TLS towards its targets with the cluster CA (a client certificate when
    they require one), and the internal token, as routers call schedulers;
    test_chart_wiring checks each file lies under the right Secret."""
    _, _, flags = _gateway(name)
    credentials = {f for f in flags if f.startswith("--tls-") or f == "--token-file"}
    assert credentials == expected
    if expected:
        assert flags["--tls-ca"] == "/etc/pagedkv/tls/ca.crt"
        assert flags["--token-file"] == "/etc/pagedkv/auth/internal-token"


def test_the_generated_router_certificate_names_the_host_the_gateway_dials() -> None:
    from cryptography import x509

    objects = manifests_of("tls")
    host = flag_values(container_of(named(objects, "Deployment", "gateway"))["args"])[
        "--target"
    ].rsplit(":", 1)[0]
    router = named(objects, "Secret", "router")
    cert = x509.load_pem_x509_certificate(base64.b64decode(router["data"]["tls.crt"]))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert host in san.get_values_for_type(x509.DNSName)


def test_the_grace_period_covers_the_gateways_drain() -> None:
    deployment, container, flags = _gateway("scaled")
    assert flags["--drain-timeout"] == "120"
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == 5
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 135


def test_network_policies_let_the_gateway_reach_its_targets_only() -> None:
    def sources(objects: list[Manifest], component: str, port: str) -> list[dict[str, Any]]:
        policy = named(objects, "NetworkPolicy", component)
        (rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == port]
        found: list[dict[str, Any]] = rule.get("from", [])
        return found

    def selects_gateway(peers: list[dict[str, Any]]) -> bool:
        return any(
            p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
            == "gateway"
            for p in peers
        )

    # With routers: the routers let it in (routerClients is set here); the
    # schedulers do not.
    objects = manifests_of("tls-existing-secrets")
    assert selects_gateway(sources(objects, "router", "grpc"))
    assert not selects_gateway(sources(objects, "scheduler", "grpc"))
    # Its own port: gatewayClients and the metrics scrapers (its /metrics is there).
    assert sources(objects, "gateway", "http") == [
        {"namespaceSelector": {"matchLabels": {"ingress": "true"}}},
        {"namespaceSelector": {"matchLabels": {"monitoring": "true"}}},
    ]
    # Without routers, the schedulers let it in; no gatewayClients: any caller.
    no_routers = manifests(
        merged(MODEL, {"router": {"enabled": False}, "gateway": {"enabled": True}})
    )
    assert selects_gateway(sources(no_routers, "scheduler", "grpc"))
    assert sources(no_routers, "gateway", "http") == []


def test_the_gateway_has_a_disruption_budget_and_a_service_monitor() -> None:
    objects = manifests_of("scaled")
    budget = named(objects, "PodDisruptionBudget", "gateway")
    assert budget["spec"]["maxUnavailable"] == 1
    monitor = named(objects, "ServiceMonitor", "gateway")
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagedkv.executor.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("model")
    make_tiny_model(path, "llama", seed=0)
    return path


def _get(base: str, path: str, token: str | None = None) -> int:
    host, port = base.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        connection.request("GET", path, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_rendered_command_line_runs_and_its_probes_need_no_token(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The `tls` set's gateway (chart tokens, TLS towards the routers) run as
    rendered, with the files of the Secrets it mounts written where its
    flags read them, the model at its flag's path and a target that does
    not answer: the readiness path says 503, the liveness path 200 without a
    token, the API 401 without one and 200 with the generated client token."""
    objects = manifests_of("tls")
    deployment, container, flags = _gateway("tls")
    secrets = {s["metadata"]["name"]: s for s in of_kind(objects, "Secret")}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    renamed = {}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        folder = tmp_path / mount["name"]
        folder.mkdir()
        for key, value in secrets[secret["secretName"]]["data"].items():
            (folder / key).write_bytes(base64.b64decode(value))
        renamed[mount["mountPath"]] = str(folder)
    renamed[flags["--model"]] = str(tiny_model)
    replaced = {
        flags["--target"]: "127.0.0.1:9",  # no gRPC server there: no target serves
        "0.0.0.0": "127.0.0.1",
        flags["--port"]: "0",
    }
    args = []
    for arg in container["args"]:
        arg = replaced.get(arg, arg)
        for mounted, local in renamed.items():
            if arg.startswith(mounted):
                arg = local + arg.removeprefix(mounted)
        args.append(arg)
    with ServedProcess([sys.executable, "-m", "pagedkv.common.cli", *args]) as gateway:
        readiness = container["readinessProbe"]["httpGet"]["path"]
        liveness = container["livenessProbe"]["httpGet"]["path"]
        assert _get(gateway.target, readiness) == 503
        assert _get(gateway.target, liveness) == 200
        assert _get(gateway.target, "/v1/models") == 401
        client_token = base64.b64decode(secrets["demo-pagedkv-auth"]["data"]["client-token"])
        assert _get(gateway.target, "/v1/models", client_token.decode()) == 200
