"""A target with no server behind it is said at once, not read as a broken
stream: "no server at HOST:PORT" from the command line and the SDK, and a
hint at ``--tls-ca`` when a plaintext client meets a TLS server (or the
other way round). The servers are real gRPC servers on 127.0.0.1 (a
one-token scheduler, plaintext or TLS); the commands run as processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pagedkv.client import AsyncClient, Client, NotConnectedError, TlsConfig
from pagedkv.client.errors import not_connected_details
from pagedkv.common.server_security import ServerSecurity, bind
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.redis_server import free_port
from tests.security.certs import CertificateAuthority, Pair


class OneToken(scheduler_pb2_grpc.SchedulerServicer):
    """Answers every Generate call with one token and usage; with ``breaks``
    the first call sends its token, then fails UNAVAILABLE (a broken stream)."""

    def __init__(self, breaks: bool = False) -> None:
        self.num_calls = 0
        self.breaks = breaks
        self.max_tokens: list[int | None] = []

    def Generate(self, request: scheduler_pb2.GenerateRequest, context: Any) -> Any:
        self.num_calls += 1
        sampling = request.sampling
        self.max_tokens.append(sampling.max_tokens if sampling.HasField("max_tokens") else None)
        done = len(request.resumed_token_ids)
        yield scheduler_pb2.GenerateResponse(
            request_id=request.request_id,
            outputs=[scheduler_pb2.SequenceOutput(token_ids=[104 + done], text_delta="h")],
        )
        if self.breaks and self.num_calls == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        yield scheduler_pb2.GenerateResponse(
            request_id=request.request_id,
            outputs=[
                scheduler_pb2.SequenceOutput(finish_reason=scheduler_pb2.FINISH_REASON_LENGTH)
            ],
            usage=scheduler_pb2.Usage(prompt_tokens=2, completion_tokens=done + 1),
        )


def _serve(servicer: OneToken, security: ServerSecurity | None = None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = bind(server, "127.0.0.1:0", security) if security else None
    if port is None:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def plaintext() -> Iterator[tuple[OneToken, str]]:
    servicer = OneToken()
    server, target = _serve(servicer)
    yield servicer, target
    server.stop(grace=None)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertificateAuthority, Pair]:
    authority = CertificateAuthority(tmp_path_factory.mktemp("pki"))
    return authority, authority.issue("server", server=True)


@pytest.fixture
def tls_server(ca: tuple[CertificateAuthority, Pair]) -> Iterator[tuple[OneToken, str]]:
    _, pair = ca
    servicer = OneToken()
    server, target = _serve(servicer, ServerSecurity(TlsConfig(cert=pair.cert, key=pair.key)))
    yield servicer, target
    server.stop(grace=None)


def _pagedkv(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pagedkv.common.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _closed_target() -> str:
    return f"127.0.0.1:{free_port()}"


# --- the command line -------------------------------------------------------------


def test_generate_against_a_closed_port_says_no_server_there_in_one_line() -> None:
    target = _closed_target()
    done = _pagedkv("generate", "--target", target, "--prompt", "hi")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"pagedkv: UNAVAILABLE: no server at {target} (connection refused)"
    ]
    assert done.stdout == ""


def test_stats_and_demo_against_a_closed_port_say_no_server_there() -> None:
    target = _closed_target()
    line = f"UNAVAILABLE: no server at {target} (connection refused)"
    stats = _pagedkv("stats", "--target", target)
    assert (stats.returncode, stats.stderr.splitlines()) == (1, [f"pagedkv: {line}"])
    demo = _pagedkv("demo", "--target", target)
    assert (demo.returncode, demo.stderr.splitlines()) == (1, [f"pagedkv demo: {line}"])
    assert demo.stdout == ""


def test_generate_moves_past_a_target_with_no_server_without_resuming(
    plaintext: tuple[OneToken, str],
) -> None:
    servicer, live = plaintext
    closed = _closed_target()
    done = _pagedkv("generate", "--target", f"{closed},{live}", "--prompt", "hi", "--json")
    assert done.returncode == 0, done.stderr
    assert servicer.num_calls == 1
    assert "broke" not in done.stderr and "resum" not in done.stderr
    assert f"no server at {closed} (connection refused); trying {live}" in done.stderr


def test_a_plaintext_generate_against_a_tls_server_is_told_of_tls_ca(
    tls_server: tuple[OneToken, str], ca: tuple[CertificateAuthority, Pair]
) -> None:
    servicer, target = tls_server
    done = _pagedkv("generate", "--target", target, "--prompt", "hi")
    assert done.returncode == 1
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("pagedkv:")]
    assert line.startswith(f"pagedkv: UNAVAILABLE: {target} closed the connection")
    assert "--tls-ca" in line
    assert "Socket closed" not in done.stderr and "resum" not in done.stderr
    authority, _ = ca
    with_ca = _pagedkv(
        "generate", "--target", target, "--prompt", "hi", "--tls-ca", str(authority.pem)
    )
    assert with_ca.returncode == 0, with_ca.stderr
    assert servicer.num_calls == 1


def test_a_tls_generate_against_a_plaintext_server_is_told_to_leave_tls_off(
    plaintext: tuple[OneToken, str], ca: tuple[CertificateAuthority, Pair]
) -> None:
    servicer, target = plaintext
    authority, _ = ca
    done = _pagedkv(
        "generate", "--target", target, "--prompt", "hi", "--tls-ca", str(authority.pem)
    )
    assert done.returncode == 1
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("pagedkv:")]
    assert line == (
        f"pagedkv: UNAVAILABLE: no TLS server at {target} (the handshake failed): if it serves "
        "plaintext, leave TLS off (no --tls-ca)"
    )
    assert servicer.num_calls == 0


def test_generate_needs_neither_a_target_nor_max_tokens(
    plaintext: tuple[OneToken, str],
) -> None:
    from pagedkv.client.cli import DEFAULT_MAX_TOKENS, _targets
    from pagedkv.common.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert _targets(args) == ["localhost:50051"]
    assert args.max_tokens == DEFAULT_MAX_TOKENS == 16
    servicer, target = plaintext
    done = _pagedkv("generate", "--target", target, "--prompt", "hi")
    assert done.returncode == 0, done.stderr
    assert servicer.max_tokens == [16]


# --- the SDK ----------------------------------------------------------------------


def test_the_sdk_raises_not_connected_at_once_and_counts_no_resume() -> None:
    target = _closed_target()
    with Client(target) as client, pytest.raises(NotConnectedError) as raised:
        client.generate_text("hi")
    assert raised.value.target == target
    assert raised.value.details == f"no server at {target} (connection refused)"
    assert client.num_resumes == 0

    async def run() -> None:
        async with AsyncClient(target) as client:
            with pytest.raises(NotConnectedError):
                await client.generate_text("hi")
            with pytest.raises(NotConnectedError):
                await client.stats()
            assert client.num_resumes == 0

    asyncio.run(run())


def test_the_sdk_tries_each_target_once_before_saying_none_answers(
    plaintext: tuple[OneToken, str],
) -> None:
    servicer, live = plaintext
    closed = [_closed_target(), _closed_target()]
    with Client([*closed, live]) as client:
        assert client.generate_text("hi").token_ids == ((104,),)
        assert client.num_resumes == 0 and servicer.num_calls == 1
    with Client(closed) as client, pytest.raises(NotConnectedError) as raised:
        client.generate_text("hi")
    assert raised.value.target in closed


def test_a_stream_that_had_an_answer_still_resumes_past_a_target_with_no_server() -> None:
    servicer = OneToken(breaks=True)
    server, live = _serve(servicer)
    try:
        from pagedkv.client import ResumePolicy

        closed = _closed_target()
        with Client([live, closed], resume=ResumePolicy(backoff_s=0.001)) as client:
            completion = client.generate_text("hi")
            # live: a token, then the break; closed: refused (a resumed call); live again
            assert completion.token_ids == ((104, 105),)
            assert client.num_resumes == 2 and servicer.num_calls == 2
    finally:
        server.stop(grace=None)


def test_what_a_failed_connection_means_is_said_per_cause() -> None:
    resolving = (
        "errors resolving nosuchhost.invalid:50051: [field:hostname lookup error:address "
        "lookup failed for nosuchhost.invalid:50051: Domain name not found]"
    )
    assert not_connected_details(resolving, "nosuchhost.invalid:50051", tls=False) == (
        "no server at nosuchhost.invalid:50051: its host name does not resolve"
    )
    # a stream that lost its server mid-call found a connection first
    assert not_connected_details("Socket closed", "a:1", tls=False) is None
    assert not_connected_details("no executor is available", "a:1", tls=False) is None


def test_the_hint_names_the_option_only_where_it_applies() -> None:
    closed = (
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:5: Socket closed"
    )
    assert "--tls-ca" in (not_connected_details(closed, "a:5", tls=False) or "")
    with_tls = not_connected_details(closed, "a:5", tls=True) or ""
    assert with_tls.startswith("could not connect to a:5: failed to connect")
