"""What the rendered manifests wire together: probes on the ports the servers
listen on, one GPU per executor, Secrets mounted where the flags read them,
grace periods that cover each tier's drain, and the NetworkPolicy's tiers."""

from __future__ import annotations

import base64
import posixpath
from typing import Any

import pytest

from pagedkv.common.redis_health import LIVENESS
from tests.deploy.chart import (
    NAMESPACE,
    VALUE_SETS,
    Manifest,
    container_of,
    flag_values,
    grpc_servers,
    manifests,
    manifests_of,
    named,
    of_kind,
    values_for,
    workloads,
)

SIZING_FLAGS = ("--num-blocks", "--gpu-memory-utilization")
"""The executor's KV sizing: one or the other."""
SECRET_FLAGS = ("-file", "--tls-", "-tls-")
"""Flags whose value is a path to secret material."""


def _component(obj: Manifest) -> str:
    component: str = obj["metadata"]["labels"]["app.kubernetes.io/component"]
    return component


def _served_port(args: list[str]) -> int:
    return int(flag_values(args)["--port"])


def _expected_secret(flag: str, component: str, values: dict[str, Any]) -> str:
    if "tls" in flag:
        existing = values.get("tls", {}).get("existingSecrets", {}).get(component)
        return existing or f"demo-pagedkv-{component}-tls"
    api_keys = values.get("gateway", {}).get("auth", {}).get("existingSecret")
    if component == "gateway" and flag == "--auth-token-file" and api_keys:
        return str(api_keys)
    if "token" in flag:
        return values.get("auth", {}).get("existingSecret") or "demo-pagedkv-auth"
    assert flag == "--redis-password-file", flag
    return values.get("redis", {}).get("auth", {}).get("existingSecret") or "demo-pagedkv-redis"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_probes_ask_grpc_health_on_a_port_the_server_listens_on(name: str) -> None:
    tls = bool(values_for(name).get("tls", {}).get("enabled"))
    for workload in grpc_servers(manifests_of(name)):
        container = container_of(workload)
        flags = flag_values(container["args"])
        served = {int(flags["--port"])}
        if tls:
            # The kubelet's gRPC probe speaks no TLS: it asks the plaintext health port.
            served = {int(flags["--health-port"])}
        declared = {p["containerPort"] for p in container["ports"]}
        probes = ["readinessProbe", "livenessProbe"]
        if _component(workload) == "executor":
            probes.append("startupProbe")
        for probe in probes:
            port = container[probe]["grpc"]["port"]
            assert port in served, f"{_component(workload)} {probe}"
            assert port in declared
            service = container[probe]["grpc"].get("service")
            if probe == "livenessProbe" and _component(workload) in ("scheduler", "router"):
                assert service == LIVENESS  # the servers' name: SERVING while they wait for Redis
            else:
                assert service is None  # the server's overall health


def test_the_executors_startup_probe_covers_a_long_model_load() -> None:
    executor = named(manifests_of("defaults"), "StatefulSet", "executor")
    startup = container_of(executor)["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_executor_asks_for_exactly_one_gpu(name: str) -> None:
    executor = named(manifests_of(name), "StatefulSet", "executor")
    resources = container_of(executor)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    args = container_of(executor)["args"]
    assert flag_values(args)["--device"] == "cuda"
    sizing = {k: v for k, v in flag_values(args).items() if k in SIZING_FLAGS}
    num_blocks = values_for(name).get("executor", {}).get("numBlocks")
    expected = {"--num-blocks": str(num_blocks)} if num_blocks else {SIZING_FLAGS[1]: "0.9"}
    assert sizing == expected


def test_schedulers_and_routers_ask_for_no_gpu() -> None:
    objects = manifests_of("scaled")
    for component in ("router", "scheduler"):
        resources = container_of(named(objects, "Deployment", component))["resources"]
        assert not any("gpu" in k for part in resources.values() for k in part)


def test_executors_advertise_their_stable_name_under_the_headless_service() -> None:
    objects = manifests_of("scaled")
    executor = named(objects, "StatefulSet", "executor")
    service = named(objects, "Service", "executor")
    assert service["spec"]["clusterIP"] == "None"
    assert executor["spec"]["serviceName"] == service["metadata"]["name"]
    flags = flag_values(container_of(executor)["args"])
    assert flags["--host"] == "0.0.0.0"
    assert flags["--advertise-address"] == (
        f"$(POD_NAME).{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:50061"
    )
    env = {e["name"]: e for e in container_of(executor)["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_process_reaches_the_same_redis(name: str) -> None:
    values = values_for(name)
    expected = values.get("redis", {}).get("url") or (
        f"redis://demo-pagedkv-redis.{NAMESPACE}.svc.cluster.local:6379/0"
    )
    for workload in grpc_servers(manifests(values)):
        flags = flag_values(container_of(workload)["args"])
        assert flags["--redis-url"] == expected
        assert flags["--host"] == "0.0.0.0"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_secret_files_lie_under_a_mount_of_the_right_secret(name: str) -> None:
    values = values_for(name)
    objects = manifests(values)
    rendered_secrets = {s["metadata"]["name"]: s for s in of_kind(objects, "Secret")}
    checked = 0
    for workload in workloads(objects):
        component = _component(workload)
        container = container_of(workload)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        for flag, path in flag_values(container["args"]).items():
            if not any(marker in flag for marker in SECRET_FLAGS) or flag.endswith("server-name"):
                continue
            mounts = [
                m for m in container["volumeMounts"] if posixpath.dirname(path) == m["mountPath"]
            ]
            assert len(mounts) == 1, f"{component} {flag} {path}: not under one mount"
            assert mounts[0].get("readOnly") is True
            secret = volumes[mounts[0]["name"]]["secret"]
            assert secret["secretName"] == _expected_secret(flag, component, values), flag
            key = posixpath.basename(path)
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            data_key = items.get(key, key) if items else key
            if secret["secretName"] in rendered_secrets:
                assert data_key in rendered_secrets[secret["secretName"]]["data"], flag
            checked += 1
    if name != "hub-cache-no-router":  # that set mounts no Secret
        assert checked > 0


def test_routers_check_scheduler_certificates_against_the_scheduler_service() -> None:
    # Schedulers register pod IPs, which the generated certificate cannot
    # name; it names the scheduler Service, and routers check that name.
    objects = manifests_of("tls")
    router = flag_values(container_of(named(objects, "Deployment", "router"))["args"])
    service = named(objects, "Service", "scheduler")["metadata"]["name"]
    name, namespace, svc = router["--scheduler-tls-server-name"].split(".")
    assert (name, svc) == (service, "svc")
    assert namespace  # the release's


def test_tls_on_gives_every_tier_its_certificate_and_executors_mutual_tls() -> None:
    objects = manifests_of("tls")
    flags = {
        component: flag_values(container_of(named(objects, kind, component))["args"])
        for component, kind in (
            ("router", "Deployment"),
            ("scheduler", "Deployment"),
            ("executor", "StatefulSet"),
        )
    }
    for tier in flags.values():
        assert tier["--tls-cert"].endswith("/tls.crt")
        assert tier["--tls-key"].endswith("/tls.key")
    assert flags["executor"]["--tls-ca"].endswith("/ca.crt")
    assert {"--executor-tls-ca", "--executor-tls-cert", "--executor-tls-key"} <= set(
        flags["scheduler"]
    )
    assert "--scheduler-tls-ca" in flags["router"]
    assert flags["router"]["--scheduler-token-file"].endswith("/internal-token")
    for tier in ("router", "scheduler"):
        assert flags[tier]["--auth-token-file"].endswith("/tokens")


def test_generated_tokens_include_the_one_routers_present() -> None:
    secret = named(manifests_of("tls"), "Secret", "auth")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    accepted = data["tokens"].split()
    assert data["internal-token"] in accepted
    assert data["client-token"] in accepted
    assert len(set(accepted)) == 2


def test_generated_certificates_share_one_ca() -> None:
    objects = manifests_of("tls")
    ca = next(s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == "demo-pagedkv-ca")
    for component in ("router", "scheduler", "executor", "gateway"):
        secret = named(objects, "Secret", component)
        assert secret["type"] == "kubernetes.io/tls"
        assert secret["data"]["ca.crt"] == ca["data"]["tls.crt"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_the_grace_period_covers_the_prestop_and_the_drain(name: str) -> None:
    for workload in workloads(manifests_of(name)):
        pod = workload["spec"]["template"]["spec"]
        container = container_of(workload)
        drain = float(flag_values(container["args"])["--drain-timeout"])
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5


def test_a_longer_drain_lengthens_the_grace_period() -> None:
    values = values_for("defaults")
    values["scheduler"] = {"drainTimeout": 120.5, "preStopSleepSeconds": 0}
    scheduler = named(manifests(values), "Deployment", "scheduler")
    assert "lifecycle" not in container_of(scheduler)
    assert scheduler["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 131


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_pods_run_as_non_root_on_a_read_only_root(name: str) -> None:
    objects = manifests_of(name)
    for workload in [*workloads(objects), *of_kind(objects, "StatefulSet")]:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        container = container_of(workload)
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert "/tmp" in writable


def test_the_model_volume_is_mounted_read_only() -> None:
    for name in ("defaults", "scaled"):
        objects = manifests_of(name)
        executor = named(objects, "StatefulSet", "executor")
        mount = next(m for m in container_of(executor)["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
        model = flag_values(container_of(executor)["args"])["--model"]
        assert model == "/models/Qwen2.5-0.5B"
    scheduler = named(manifests_of("scaled"), "Deployment", "scheduler")
    assert flag_values(container_of(scheduler)["args"])["--model"] == "/models/Qwen2.5-0.5B"


def test_a_hub_cache_passes_the_hub_id_and_points_hf_hub_cache_at_it() -> None:
    executor = named(manifests_of("hub-cache-no-router"), "StatefulSet", "executor")
    assert flag_values(container_of(executor)["args"])["--model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    env = {e["name"]: e.get("value") for e in container_of(executor)["env"]}
    assert env["HF_HUB_CACHE"] == "/models"


def _ingress_sources(policy: Manifest, port: str) -> list[dict[str, Any]]:
    rules = [
        rule
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == port for p in rule.get("ports", []))
    ]
    assert len(rules) == 1
    sources: list[dict[str, Any]] = rules[0].get("from", [])
    return sources


def test_only_schedulers_reach_executors_and_only_routers_and_clients_reach_schedulers() -> None:
    objects = manifests_of("defaults")
    policies = {_component(p): p for p in of_kind(objects, "NetworkPolicy")}
    assert set(policies) == {"router", "scheduler", "executor", "redis"}

    def component_of(source: dict[str, Any]) -> str:
        component: str = source["podSelector"]["matchLabels"].get(
            "app.kubernetes.io/component", "client"
        )
        return component

    executor_sources = _ingress_sources(policies["executor"], "grpc")
    assert [component_of(s) for s in executor_sources] == ["scheduler"]
    assert len(policies["executor"]["spec"]["ingress"]) == 1
    scheduler_sources = _ingress_sources(policies["scheduler"], "grpc")
    assert [component_of(s) for s in scheduler_sources] == ["router", "client"]
    assert scheduler_sources[1]["podSelector"]["matchLabels"] == {"pagedkv-client": "true"}
    redis_sources = _ingress_sources(policies["redis"], "redis")
    assert sorted(component_of(s) for s in redis_sources) == ["executor", "router", "scheduler"]
    for source in [*executor_sources, *scheduler_sources[:1], *redis_sources]:
        assert source["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "demo"


def test_every_tier_has_a_disruption_budget() -> None:
    objects = manifests_of("scaled")
    budgets = {
        _component(b): b["spec"]["maxUnavailable"] for b in of_kind(objects, "PodDisruptionBudget")
    }
    assert budgets == {"router": 1, "scheduler": 1, "executor": 1, "gateway": 1}


def test_generated_certificates_name_what_clients_dial_and_serve_both_ends() -> None:
    """An executor's certificate covers its pod name under the headless
    Service (what schedulers dial); the schedulers' doubles as their client
    certificate towards executors (mutual TLS), so every tier's carries both
    key usages and the CA's signature."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import padding
    from cryptography.x509.oid import ExtendedKeyUsageOID

    objects = manifests_of("tls")
    ca_secret = next(
        s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == "demo-pagedkv-ca"
    )
    ca = x509.load_pem_x509_certificate(base64.b64decode(ca_secret["data"]["tls.crt"]))
    names = {}
    for component in ("router", "scheduler", "executor"):
        secret = named(objects, "Secret", component)
        cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
        ca.public_key().verify(
            cert.signature,
            cert.tbs_certificate_bytes,
            padding.PKCS1v15(),
            cert.signature_hash_algorithm,
        )
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names[component] = set(san.get_values_for_type(x509.DNSName))
    executor = named(objects, "StatefulSet", "executor")
    dialed = flag_values(container_of(executor)["args"])["--advertise-address"]
    host = dialed.rsplit(":", 1)[0].replace("$(POD_NAME)", "*")
    assert host in names["executor"]
    assert f"demo-pagedkv-router.{NAMESPACE}.svc" in names["router"]
    assert "localhost" in names["router"]  # kubectl port-forward, as NOTES.txt shows
