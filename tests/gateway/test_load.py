"""The gateway under load and through a restart, in front of a real stack
(``pagedkv serve``, one CPU executor on a tiny llama): 200 concurrent
streams all complete with the text of one alone, and a gateway stopped with
SIGTERM and started again on the same port loses no request (clients retry
what had not started; what had started finishes during the drain)."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import openai
import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from tests.gateway.stack import Gateway, free_port, nothing_held, wait_until
from tests.service.stack import Process, serve

MODEL = "tiny"
NUM_STREAMS = 200
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("load") / "llama"
    make_tiny_model(path, "llama", seed=7)
    return path


@pytest.fixture(scope="module")
def stack(model: Path):
    with serve(model, executors=1, num_blocks=1024) as process:
        yield process


def test_200_concurrent_streams_all_complete(stack: Process, model: Path) -> None:
    prompts = [f"stream {i}: hello" for i in range(NUM_STREAMS)]

    async def run(url: str) -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:

            async def one(prompt: str, stream: bool) -> str:
                if not stream:
                    done = await client.completions.create(
                        model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    return done.choices[0].text
                events = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                    stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                parts, reasons = [], []
                async for event in events:
                    parts.append(event.choices[0].text)
                    reasons.append(event.choices[0].finish_reason)
                assert reasons[-1] == "length"
                return "".join(parts)

            streamed = await asyncio.gather(*(one(p, True) for p in prompts))
            alone = [await one(p, False) for p in prompts[:8]]
            return list(streamed), alone

    extra = ("--served-model-name", MODEL)
    with Gateway(stack.target, model, extra) as gateway:
        streamed, alone = asyncio.run(run(f"{gateway.url}/v1"))
    assert len(streamed) == NUM_STREAMS
    assert streamed[:8] == alone
    wait_until(lambda: nothing_held(stack.target), 60, "all blocks free")


@pytest.mark.slow
def test_a_gateway_restart_loses_no_request(stack: Process, model: Path) -> None:
    port = free_port()
    # a later --port wins over Gateway's --port 0
    command_extra = ("--served-model-name", MODEL, "--drain-timeout", "30", "--port", str(port))
    url = f"http://127.0.0.1:{port}/v1"
    num_threads, num_each = 4, 12
    texts: dict[tuple[int, int], str] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(num_threads + 1)

    def client_thread(t: int) -> None:
        # Generous retries: the gateway is away for a few seconds.
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=12) as client:
            started.wait()
            for i in range(num_each):
                try:
                    done = client.completions.create(
                        model=MODEL, prompt=f"restart {t}", max_tokens=NEW_TOKENS,
                        temperature=0, extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    texts[(t, i)] = done.choices[0].text
                except BaseException as exc:  # reported below
                    errors.append(exc)

    first = Gateway(stack.target, model, command_extra)
    threads = [threading.Thread(target=client_thread, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    try:
        started.wait()
        wait_until(lambda: len(texts) >= num_threads, 120, "requests answered")
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=60) == 0
        second = Gateway(stack.target, model, command_extra)
    finally:
        first.close()
    with second:
        for thread in threads:
            thread.join(timeout=300)
    assert not errors, errors
    assert len(texts) == num_threads * num_each
    for t in range(num_threads):
        assert len({texts[(t, i)] for i in range(num_each)}) == 1  # greedy: the same each time
