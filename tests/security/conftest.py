"""Fixtures of the security tests: test certificates (a cluster CA and an
outsider's), secrets, and one closed cluster per module: a redis-server that
requires a password, an executor serving mutual TLS, a scheduler (mutual TLS
towards the executor, TLS and bearer tokens towards its clients) and a router
in front (TLS, tokens, its own token towards the scheduler)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pagedkv.common.bearer_tokens import bearer_metadata
from pagedkv.common.security import TlsConfig
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.cluster.cluster_stack import SchedulerProcess, wait_until
from tests.executor.driver import ExecutorProcess
from tests.redis_server import RedisServer, free_port
from tests.router.router_stack import References, RouterProcess
from tests.security.certs import CertificateAuthority, Pair


@dataclass(frozen=True)
class Pki:
    """The cluster CA and what it issued; an outsider CA's client certificate."""

    ca: Path
    server: Pair  # served by every service here (names 127.0.0.1 and localhost)
    client: Pair  # a cluster client: schedulers towards executors, routers, the SDK
    other_ca: Path
    intruder: Pair  # a client certificate of the other CA

    def tls(self, *, client: Pair | None = None) -> TlsConfig:
        """A client's TlsConfig trusting the cluster CA, presenting ``client``."""
        if client is None:
            return TlsConfig(ca=self.ca)
        return TlsConfig(ca=self.ca, cert=client.cert, key=client.key)

    def channel(self, target: str, *, client: Pair | None = None) -> grpc.Channel:
        from pagedkv.common.security import open_channel

        return open_channel(target, self.tls(client=client))


@dataclass(frozen=True)
class Secrets:
    """The secrets of the closed cluster, each in its own file."""

    client_token: str  # accepted by the router and the scheduler
    router_token: str  # the router's own towards the scheduler
    redis_password: str
    router_tokens: Path  # the router's --auth-token-file
    scheduler_tokens: Path  # the scheduler's --auth-token-file
    router_token_file: Path  # the router's --scheduler-token-file
    redis_password_file: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    cluster = CertificateAuthority(directory / "cluster")
    other = CertificateAuthority(directory / "other", name="another CA")
    return Pki(
        ca=cluster.pem,
        server=cluster.issue("server", server=True),
        client=cluster.issue("client", server=False),
        other_ca=other.pem,
        intruder=other.issue("intruder", server=False),
    )


@pytest.fixture(scope="module")
def cluster_secrets(tmp_path_factory: pytest.TempPathFactory) -> Secrets:
    directory = tmp_path_factory.mktemp("secrets")
    client_token, router_token = f"cli-{secrets.token_hex(16)}", f"rtr-{secrets.token_hex(16)}"
    password = f"pw-{secrets.token_hex(16)}"
    files = {
        "router-tokens": f"# clients of the router\n{client_token}\n\n",
        "scheduler-tokens": f"{client_token}\n# the router\n{router_token}\n",
        "router-token": f"{router_token}\n",
        "redis-password": f"{password}\n",
    }
    for name, content in files.items():
        (directory / name).write_text(content)
    return Secrets(
        client_token=client_token,
        router_token=router_token,
        redis_password=password,
        router_tokens=directory / "router-tokens",
        scheduler_tokens=directory / "scheduler-tokens",
        router_token_file=directory / "router-token",
        redis_password_file=directory / "redis-password",
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("security") / "llama"
    make_tiny_model(path, "llama", seed=7)
    return path


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> References:
    return References(model_dir)


@dataclass
class ClosedCluster:
    """The running processes of the closed cluster."""

    redis: RedisServer
    executor: ExecutorProcess
    scheduler: SchedulerProcess
    router: RouterProcess
    health_ports: dict[str, int]  # "executor", "scheduler", "router" -> its --health-port

    def processes(self) -> list[ExecutorProcess | SchedulerProcess | RouterProcess]:
        return [self.executor, self.scheduler, self.router]


def server_tls_args(pki: Pki) -> tuple[str, ...]:
    return ("--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key))


def client_tls_args(prefix: str, pki: Pki) -> tuple[str, ...]:
    return (
        f"--{prefix}tls-ca",
        str(pki.ca),
        f"--{prefix}tls-cert",
        str(pki.client.cert),
        f"--{prefix}tls-key",
        str(pki.client.key),
    )


def router_stats(cluster: ClosedCluster, pki: Pki, token: str) -> scheduler_pb2.GetStatsResponse:
    with pki.channel(cluster.router.target, client=pki.client) as channel:
        response: scheduler_pb2.GetStatsResponse = scheduler_pb2_grpc.SchedulerStub(
            channel
        ).GetStats(scheduler_pb2.GetStatsRequest(), timeout=30, metadata=bearer_metadata(token))
    return response


@pytest.fixture(scope="module")
def closed_cluster(model_dir: Path, pki: Pki, cluster_secrets: Secrets) -> Iterator[ClosedCluster]:
    password_file = ("--redis-password-file", str(cluster_secrets.redis_password_file))
    with RedisServer(password=cluster_secrets.redis_password) as redis_server:
        url = redis_server.url
        health = {name: free_port() for name in ("executor", "scheduler", "router")}
        executor = ExecutorProcess(
            model_dir,
            num_blocks=128,
            extra_args=(
                "--redis-url",
                url,
                *password_file,
                *server_tls_args(pki),
                "--tls-ca",
                str(pki.ca),
                "--health-port",
                str(health["executor"]),
            ),
        )
        scheduler = router = None
        try:
            scheduler = SchedulerProcess(
                url,
                *password_file,
                *server_tls_args(pki),
                "--auth-token-file",
                str(cluster_secrets.scheduler_tokens),
                *client_tls_args("executor-", pki),
                "--health-port",
                str(health["scheduler"]),
            )
            router = RouterProcess(
                url,
                *password_file,
                *server_tls_args(pki),
                "--tls-ca",
                str(pki.ca),
                "--auth-token-file",
                str(cluster_secrets.router_tokens),
                *client_tls_args("scheduler-", pki),
                "--scheduler-token-file",
                str(cluster_secrets.router_token_file),
                "--health-port",
                str(health["router"]),
            )
            cluster = ClosedCluster(redis_server, executor, scheduler, router, health)

            def sees_the_executor() -> bool:
                stats = router_stats(cluster, pki, cluster_secrets.client_token)
                return any(e.owner_id for e in stats.cluster.executors) and bool(stats.executors)

            wait_until(sees_the_executor, what="the router sees the leased executor")
            yield cluster
        finally:
            for process in (router, scheduler, executor):
                if process is not None:
                    process.close()
