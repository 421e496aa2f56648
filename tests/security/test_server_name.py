"""A server reached at an address its certificate does not name (a pod IP)
is verified against the name given instead (``--*-tls-server-name``,
``TlsConfig.server_name``), and refused without it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedkv.common.security import TlsConfig, open_channel
from pagedkv.common.server_security import ServerSecurity, bind
from tests.security.certs import CertificateAuthority

SERVICE_NAME = "pagedkv-scheduler.llm.svc"


@pytest.fixture(scope="module")
def server_named_elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    ca = CertificateAuthority(tmp_path_factory.mktemp("server-name"))
    pair = ca.issue("scheduler", server=True, dns_names=(SERVICE_NAME,))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = bind(server, "127.0.0.1:0", ServerSecurity(TlsConfig(cert=pair.cert, key=pair.key)))
    server.start()
    yield ca.pem, port
    server.stop(None)


def check(target: str, tls: TlsConfig) -> grpc.StatusCode:
    with open_channel(target, tls) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_certificate_not_naming_the_address_is_refused_without_a_server_name(
    server_named_elsewhere: tuple[Path, int],
) -> None:
    ca, port = server_named_elsewhere
    assert check(f"127.0.0.1:{port}", TlsConfig(ca=ca)) == grpc.StatusCode.UNAVAILABLE


def test_the_server_name_is_checked_instead_of_the_address(
    server_named_elsewhere: tuple[Path, int],
) -> None:
    ca, port = server_named_elsewhere
    named = TlsConfig(ca=ca, server_name=SERVICE_NAME)
    assert check(f"127.0.0.1:{port}", named) == grpc.StatusCode.OK
    wrong = TlsConfig(ca=ca, server_name="another.llm.svc")
    assert check(f"127.0.0.1:{port}", wrong) == grpc.StatusCode.UNAVAILABLE
