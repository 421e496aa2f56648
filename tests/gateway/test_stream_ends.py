"""How a stream through the gateway ends when a process goes away under it:
a gateway stopped with SIGTERM lets the stream in flight finish (then exits
0, refusing new connections meanwhile), and a stream whose scheduler is
killed ends with one ``data: {"error": ...}`` event (503, no ``[DONE]``)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from tests.gateway.stack import Gateway
from tests.service.stack import serve

MODEL = "tiny"
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 300, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stream-ends") / "llama"
    make_tiny_model(path, "llama", seed=7)
    return path


def events(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_a_stopping_gateway_finishes_the_stream_in_flight(model: Path) -> None:
    with serve(model, num_blocks=128) as stack:
        gateway = Gateway(stack.target, model, ("--served-model-name", MODEL))
        try:
            with httpx.stream("POST", f"{gateway.url}/v1/completions", json=BODY) as response:
                data = events(response.iter_lines())
                first = json.loads(next(data))
                gateway.process.send_signal(signal.SIGTERM)
                rest = list(data)
            assert gateway.process.wait(timeout=60) == 0
        finally:
            gateway.close()
    assert rest[-1] == "[DONE]"
    assert first["choices"][0]["finish_reason"] is None
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"


def test_a_stream_whose_scheduler_dies_ends_with_an_error_event(model: Path) -> None:
    stack = serve(model, num_blocks=128)
    try:
        with (
            Gateway(stack.target, model, ("--served-model-name", MODEL)) as gateway,
            httpx.stream("POST", f"{gateway.url}/v1/completions", json=BODY) as response,
        ):
            assert response.status_code == 200
            data = events(response.iter_lines())
            json.loads(next(data))
            stack.process.send_signal(signal.SIGKILL)
            rest = list(data)
    finally:
        stack.close()
    assert rest and rest[-1] != "[DONE]"
    error = json.loads(rest[-1])["error"]
    assert error["code"] == "service_unavailable" and error["type"] == "server_error"
