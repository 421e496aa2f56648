"""Renders the Helm chart offline (helm's own library through helm-python-sdk,
no helm binary, no cluster) for the deploy tests, and names the value sets
they share."""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pagedkv"
RELEASE = "demo"
NAMESPACE = "llm"
KUBE_VERSION = "1.30.0"

Values = dict[str, Any]
Manifest = dict[str, Any]

MODEL = {"model": {"name": "Qwen2.5-0.5B", "persistentVolumeClaim": {"claimName": "models"}}}
"""The one value the chart requires (with a volume to find the model in)."""

VALUE_SETS: dict[str, Values] = {
    "defaults": {},
    "external-redis": {
        "redis": {
            "enabled": False,
            "url": "rediss://redis.example.internal:6380/2",
            "auth": {"existingSecret": "redis-credentials", "passwordKey": "redis-password"},
        },
    },
    "tls": {
        "tls": {"enabled": True, "generate": True},
        "auth": {"enabled": True},
        "gateway": {"enabled": True},
    },
    "tls-existing-secrets": {
        "tls": {
            "enabled": True,
            "requireClientCertificates": True,
            "existingSecrets": {
                "router": "router-cert",
                "scheduler": "scheduler-cert",
                "executor": "executor-cert",
                "gateway": "gateway-cert",
            },
        },
        "auth": {"enabled": True, "existingSecret": "pagedkv-tokens"},
        "gateway": {
            "enabled": True,
            "auth": {"existingSecret": "api-keys", "tokensKey": "keys.txt"},
        },
        "networkPolicy": {
            "routerClients": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
            "gatewayClients": [{"namespaceSelector": {"matchLabels": {"ingress": "true"}}}],
            "metricsScrapers": [{"namespaceSelector": {"matchLabels": {"monitoring": "true"}}}],
        },
    },
    "scaled": {
        "router": {"replicas": 3},
        "scheduler": {"replicas": 4},
        "executor": {"replicas": 8, "maxModelLen": 8192, "enforceEager": True},
        "gateway": {
            "enabled": True,
            "replicas": 2,
            "servedModelName": "qwen",
            "drainTimeout": 120,
            "service": {"type": "LoadBalancer", "port": 80},
        },
        "model": {
            "persistentVolumeClaim": {"claimName": ""},
            "hostPath": {"path": "/mnt/models"},
            "mountOnSchedulers": True,
        },
        "redis": {"persistence": {"enabled": True, "storageClass": "fast"}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "hub-cache-no-router": {
        "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct", "hubCache": True},
        "executor": {"numBlocks": 4096},
        "router": {"enabled": False},
        "redis": {"auth": {"enabled": False}},
        "networkPolicy": {"enabled": False},
        "gateway": {"enabled": True, "port": 8080},
    },
}


def merged(*layers: Mapping[str, Any]) -> Values:
    """The layers merged key by key (later ones win), as helm merges -f files."""
    out: Values = {}
    for layer in layers:
        _merge_into(out, layer)
    return out


def _merge_into(out: Values, layer: Mapping[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            _merge_into(out[key], value)
        else:
            out[key] = copy.deepcopy(value)


def values_for(name: str) -> Values:
    """The values of the named set, on top of the required model."""
    return merged(MODEL, VALUE_SETS[name])


def render(values: Values) -> dict[str, str]:
    """Each template's rendered text, by template path (NOTES.txt included);
    raises helm's errors (a failed `required`/`fail`, a schema violation)."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def manifests(values: Values) -> list[Manifest]:
    """Every Kubernetes object the chart renders with ``values``."""
    objects: list[Manifest] = []
    for path, text in sorted(render(values).items()):
        if path.endswith(".txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


@functools.cache
def _manifests_of(name: str) -> tuple[Manifest, ...]:
    return tuple(manifests(values_for(name)))


def manifests_of(name: str) -> list[Manifest]:
    """What the named value set renders (rendered once per test session; copies)."""
    return copy.deepcopy(list(_manifests_of(name)))


def of_kind(objects: list[Manifest], kind: str) -> list[Manifest]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[Manifest], kind: str, component: str) -> Manifest:
    """The one object of ``kind`` for a tier (its component label)."""
    found = [
        o
        for o in of_kind(objects, kind)
        if o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, f"{len(found)} {kind} objects for {component}"
    return found[0]


def workloads(objects: list[Manifest]) -> Iterator[Manifest]:
    """The pagedkv Deployments and StatefulSets (not the bundled Redis), the
    HTTP gateway included."""
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet") and (
            o["metadata"]["labels"]["app.kubernetes.io/component"] != "redis"
        ):
            yield o


def grpc_servers(objects: list[Manifest]) -> Iterator[Manifest]:
    """The gRPC tiers' workloads (routers, schedulers, executors): those
    with Redis and gRPC health; not the HTTP gateway."""
    for o in workloads(objects):
        if o["metadata"]["labels"]["app.kubernetes.io/component"] != "gateway":
            yield o


def container_of(workload: Manifest) -> dict[str, Any]:
    """The workload's one container."""
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def flag_values(args: list[str]) -> dict[str, str]:
    """Each --flag followed by a value (not another flag)."""
    return {
        flag: value
        for flag, value in itertools.pairwise(args)
        if flag.startswith("--") and not value.startswith("--")
    }


def load_values_file() -> Values:
    loaded: Values = yaml.safe_load((CHART / "values.yaml").read_text())
    return loaded
