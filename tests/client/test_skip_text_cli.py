"""``pagedkv generate --skip-text`` asks a (scripted) Scheduler for token ids only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pagedkv.client.options import generate_request
from pagedkv.common.cli import main
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc


class RecordingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records each request; answers one token, with text unless skip_text."""

    def __init__(self) -> None:
        self.requests: list[scheduler_pb2.GenerateRequest] = []

    def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: Any
    ) -> Iterator[scheduler_pb2.GenerateResponse]:
        self.requests.append(request)
        output = scheduler_pb2.SequenceOutput(
            token_ids=[104],
            text_delta="" if request.skip_text else "h",
            finish_reason=scheduler_pb2.FINISH_REASON_LENGTH,
        )
        yield scheduler_pb2.GenerateResponse(request_id="r-1", outputs=[output])
        yield scheduler_pb2.GenerateResponse(
            request_id="r-1", usage=scheduler_pb2.Usage(prompt_tokens=1, completion_tokens=1)
        )


@pytest.fixture
def scheduler() -> Iterator[tuple[str, RecordingScheduler]]:
    servicer = RecordingScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def _generate(target: str, *extra: str) -> list[str]:
    return ["generate", "--target", target, "--prompt", "hi", "--max-tokens", "1", *extra]


def test_generate_request_sets_skip_text_only_when_asked() -> None:
    assert generate_request("hi", skip_text=True).skip_text
    assert not generate_request("hi").skip_text


def test_skip_text_with_json_prints_token_ids_and_empty_text(
    scheduler: tuple[str, RecordingScheduler], capsys: pytest.CaptureFixture[str]
) -> None:
    target, servicer = scheduler
    assert main(_generate(target, "--json", "--skip-text")) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["sequences"][0]["token_ids"] == [104]
    assert first["sequences"][0]["text"] == ""
    assert [r.skip_text for r in servicer.requests] == [True]


def test_skip_text_without_json_is_refused_before_any_call(
    scheduler: tuple[str, RecordingScheduler], capsys: pytest.CaptureFixture[str]
) -> None:
    target, servicer = scheduler
    assert main(_generate(target, "--skip-text")) == 2
    assert "--json" in capsys.readouterr().err
    assert servicer.requests == []
