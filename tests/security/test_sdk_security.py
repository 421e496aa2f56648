"""The SDK over TLS with a token: a stream that breaks resumes on the next
target, and every call (the resumed ones included) carries the token, over
TLS, with the client certificate. Scripted in-process schedulers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pagedkv.client import AsyncClient, Client, ResumePolicy, UnavailableError
from pagedkv.common.security import TlsConfig
from pagedkv.common.server_security import ServerSecurity, bind
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.client.test_resume import Scripted
from tests.security.conftest import Pki

TOKEN = "sdk-token-0123456789"


class Recording(Scripted):
    """A scripted scheduler that also keeps each call's authorization."""

    def __init__(self) -> None:
        super().__init__([])
        self.authorizations: list[str] = []

    def Generate(self, request: scheduler_pb2.GenerateRequest, context: Any) -> Any:
        metadata = dict(context.invocation_metadata())
        self.authorizations.append(metadata.get("authorization", ""))
        yield from super().Generate(request, context)


@pytest.fixture
def tls_schedulers(pki: Pki) -> Iterator[list[tuple[Recording, str]]]:
    """Two scripted schedulers serving mutual TLS with the cluster CA."""
    security = ServerSecurity(TlsConfig(ca=pki.ca, cert=pki.server.cert, key=pki.server.key))
    servers, made = [], []
    for _ in range(2):
        servicer = Recording()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        port = bind(server, "127.0.0.1:0", security)
        server.start()
        servers.append(server)
        made.append((servicer, f"127.0.0.1:{port}"))
    yield made
    for server in servers:
        server.stop(grace=None)


def test_a_resumed_stream_carries_the_token_over_tls(
    tls_schedulers: list[tuple[Recording, str]], pki: Pki
) -> None:
    (first, a), (second, b) = tls_schedulers
    tls = pki.tls(client=pki.client)
    policy = ResumePolicy(backoff_s=0.001)
    first.script, second.script = ["break"], ["finish"]
    with Client([a, b], tls=tls, token=TOKEN, resume=policy) as client:
        assert client.generate_text("Hi", max_tokens=5).text == "Hello"
        assert client.num_resumes == 1

    async def run() -> str:
        async with AsyncClient([a, b], tls=tls, token=TOKEN, resume=policy) as client:
            completion = await client.generate_text("Hi", max_tokens=5)
            assert client.num_resumes == 1
            return completion.text

    first.script, second.script = ["break"], ["finish"]
    assert asyncio.run(run()) == "Hello"
    calls = [*first.authorizations, *second.authorizations]
    assert calls == [f"Bearer {TOKEN}"] * 4


def test_a_client_without_the_cluster_certificate_is_refused(
    tls_schedulers: list[tuple[Recording, str]], pki: Pki
) -> None:
    (first, a), _ = tls_schedulers
    first.script = ["finish"]
    for tls in (pki.tls(), pki.tls(client=pki.intruder), TlsConfig(ca=pki.other_ca)):
        policy = ResumePolicy(max_attempts=1, backoff_s=0.001)
        with (
            Client(a, tls=tls, timeout=10, resume=policy) as client,
            pytest.raises(UnavailableError),
        ):
            client.generate_text("Hi", max_tokens=5)
    assert first.authorizations == []


def test_an_unprintable_token_is_refused_without_showing_it() -> None:
    with pytest.raises(ValueError, match="token: must be printable ASCII") as error:
        Client("127.0.0.1:1", token="bad token\n")
    assert "bad token" not in str(error.value)
