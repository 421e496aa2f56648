"""What ``pagedkv generate`` and ``pagedkv stats`` write, over a real channel to
a scripted Scheduler: a model's control bytes never reach a terminal raw, and
targets without a port mean the scheduler's default port."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pagedkv.client import AsyncClient, Client
from pagedkv.common.cli import DEFAULT_SCHEDULER_PORT, main, target_with_port
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

RAW = "red \x1b[31mtext\x1b[0m\r\x07bell\ttab\nline \x85 end"
"""What the scripted model says: ANSI escapes, a carriage return, a bell, a C1
control, and the tab and newline a terminal should still get."""

ESCAPED = "red \\x1b[31mtext\\x1b[0m\\x0d\\x07bell\ttab\nline \\x85 end"


class RawBytesScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams ``RAW`` in two deltas to every sequence of every request."""

    def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: Any
    ) -> Iterator[scheduler_pb2.GenerateResponse]:
        n = max(request.sampling.n, 1)
        half = len(RAW) // 2
        for delta, reason in ((RAW[:half], None), (RAW[half:], scheduler_pb2.FINISH_REASON_LENGTH)):
            yield scheduler_pb2.GenerateResponse(
                request_id="r-1",
                outputs=[
                    scheduler_pb2.SequenceOutput(
                        index=i, token_ids=[1], text_delta=delta, finish_reason=reason
                    )
                    for i in range(n)
                ],
            )
        yield scheduler_pb2.GenerateResponse(
            request_id="r-1",
            usage=scheduler_pb2.Usage(prompt_tokens=1, completion_tokens=2 * n),
        )


class Terminal(io.StringIO):
    """A stdout that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(RawBytesScheduler(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def _generate(target: str, *extra: str) -> list[str]:
    return ["generate", "--target", target, "--prompt", "hi", "--max-tokens", "2", *extra]


def test_on_a_terminal_control_bytes_are_escaped_but_newline_and_tab_kept(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(_generate(target)) == 0
    assert terminal.getvalue() == ESCAPED + "\n"

    terminal.seek(0)
    terminal.truncate()
    assert main(_generate(target, "--n", "2")) == 0
    assert terminal.getvalue() == (
        f"--- sequence 0 (length) ---\n{ESCAPED}\n--- sequence 1 (length) ---\n{ESCAPED}\n"
    )


def test_piped_output_and_json_carry_the_model_text_unchanged(
    target: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(_generate(target)) == 0
    assert capsys.readouterr().out == RAW + "\n"

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert main(_generate(target, "--json")) == 0
    lines = sys.stdout.getvalue().splitlines()
    assert "".join(json.loads(line)["sequences"][0]["text"] for line in lines[:2]) == RAW


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("localhost", f"localhost:{DEFAULT_SCHEDULER_PORT}"),
        ("10.0.0.5", f"10.0.0.5:{DEFAULT_SCHEDULER_PORT}"),
        ("[::1]", f"[::1]:{DEFAULT_SCHEDULER_PORT}"),
        ("localhost:7000", "localhost:7000"),
        ("[::1]:7000", "[::1]:7000"),
        ("dns:///scheduler.local:7000", "dns:///scheduler.local:7000"),
        ("unix:/run/pagedkv.sock", "unix:/run/pagedkv.sock"),
    ],
)
def test_a_target_without_a_port_gets_the_scheduler_default_port(given: str, meant: str) -> None:
    assert target_with_port(given) == meant


def test_clients_and_commands_take_a_host_alone(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client("localhost") as client:
        assert client.target == f"localhost:{DEFAULT_SCHEDULER_PORT}"

    async def async_target() -> str:
        async with AsyncClient("localhost") as aclient:
            return aclient.target

    assert asyncio.run(async_target()) == f"localhost:{DEFAULT_SCHEDULER_PORT}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"HOST[:PORT] (default port: {DEFAULT_SCHEDULER_PORT}," in help_text


def test_serve_and_scheduler_listen_on_the_default_scheduler_port() -> None:
    from pagedkv.common.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).port == DEFAULT_SCHEDULER_PORT
    assert parser.parse_args(["scheduler", "--executor", "h:1"]).port == DEFAULT_SCHEDULER_PORT
