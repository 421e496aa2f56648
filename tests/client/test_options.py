"""Every request option reaches the GenerateRequest the same way from
``Client``, ``AsyncClient`` and ``pagedkv generate``: as ``generate_request``
puts it (a scripted Scheduler records what each sends)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pagedkv.client import AsyncClient, Client, GenerateOptions
from pagedkv.client.cli import GENERATE_FLAGS
from pagedkv.client.options import OPTION_NAMES, generate_request
from pagedkv.common.cli import main
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

EVERY_OPTION: GenerateOptions = {
    "token_ids": [5, 6],
    "max_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.75,
    "top_k": 3,
    "seed": 11,
    "n": 2,
    "beam_width": 3,
    "stop_token_ids": [13, 198],
    "ignore_eos": True,
    "stop": ["END", "###"],
    "include_stop_str_in_output": True,
    "min_tokens": 2,
    "logprobs": 1,
    "cache_salt": "tenant-a",
    "priority": -1,
    "request_id": "r-1",
    "skip_text": True,
}
"""Every option, none at its default."""


class RecordingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records each request; answers a final chunk at once."""

    def __init__(self) -> None:
        self.requests: list[scheduler_pb2.GenerateRequest] = []

    def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: Any
    ) -> Iterator[scheduler_pb2.GenerateResponse]:
        self.requests.append(request)
        yield scheduler_pb2.GenerateResponse(request_id=request.request_id or "r")
        yield scheduler_pb2.GenerateResponse(
            request_id=request.request_id or "r", usage=scheduler_pb2.Usage(prompt_tokens=2)
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


def _flags(options: GenerateOptions) -> list[str]:
    """The ``pagedkv generate`` flags of ``options`` (those it has a flag for)."""
    argv: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if name not in GENERATE_FLAGS and name != "token_ids":
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list) and name == "stop":  # repeated
            argv += [part for stop in value for part in (flag, stop)]
        elif isinstance(value, list):  # comma-separated
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def test_the_test_sets_every_option_and_the_cli_names_only_options() -> None:
    assert set(EVERY_OPTION) == OPTION_NAMES
    assert set(GENERATE_FLAGS) <= OPTION_NAMES
    assert OPTION_NAMES - set(GENERATE_FLAGS) == {
        "token_ids",  # with --prompt, one of the two
        "cache_salt",
        "priority",
        "request_id",
    }


def test_a_keyword_that_is_no_option_is_refused_before_any_call() -> None:
    with pytest.raises(TypeError, match="max_token"):
        generate_request("hi", max_token=8)  # type: ignore[call-arg]


def test_sync_async_and_cli_send_every_option_alike(
    scheduler: tuple[str, RecordingScheduler],
) -> None:
    target, servicer = scheduler
    with Client(target) as client:
        client.generate_text(**EVERY_OPTION)

    async def run() -> None:
        async with AsyncClient(target) as client:
            await client.generate_text(**EVERY_OPTION)

    asyncio.run(run())
    assert main(["generate", "--target", target, "--json", *_flags(EVERY_OPTION)]) == 0

    expected = generate_request(**EVERY_OPTION)
    sync_request, async_request, cli_request = servicer.requests
    assert sync_request == expected
    assert async_request == expected
    # the CLI has no flag for these: they keep their defaults (a fresh request_id)
    for field, default in (("cache_salt", ""), ("priority", 0)):
        assert getattr(cli_request, field) == default
        setattr(cli_request, field, getattr(expected, field))
    assert len(cli_request.request_id) == 32
    cli_request.request_id = expected.request_id
    assert cli_request == expected


def test_a_flag_not_given_is_not_sent_so_the_sdk_default_applies(
    scheduler: tuple[str, RecordingScheduler],
) -> None:
    target, servicer = scheduler
    assert main(["generate", "--target", target, "--json", "--prompt", "hi"]) == 0
    (request,) = servicer.requests
    expected = generate_request("hi", max_tokens=16, request_id=request.request_id)
    assert request == expected
