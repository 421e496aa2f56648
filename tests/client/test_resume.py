"""The SDK resumes a broken Generate stream on another scheduler.

Over real processes: two independent stacks on the tiny llama, each a
``pagedkv scheduler`` over its own CPU executor (no Redis: they do not know
each other). A ``Client`` (or ``AsyncClient``) given both targets starts its
first request on the first; that scheduler is SIGKILLed once the first
chunks arrived, and the stream completes on the other with exactly the tokens
and text of an uninterrupted run. Requests with n > 1 are not resumed.

And, against scripted in-process schedulers: what is sent on a resume (same
request_id and prompt, the tokens received as ``resumed_token_ids``), which
failures count as a break, ALREADY_EXISTS on a resume, and the bounds.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedkv.client import (
    AlreadyExistsError,
    AsyncClient,
    Client,
    Completion,
    GenerateChunk,
    InvalidArgumentError,
    PagedkvError,
    ResumePolicy,
    UnavailableError,
)
from pagedkv.common.cli import main
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import hf_greedy, model_dirs
from tests.service.stack import Process

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

PROMPT = "Resuming keeps every token: " * 12  # 336 byte tokens: slower steps
NUM_TOKENS = 160
FINISH_ERROR = scheduler_pb2.FINISH_REASON_ERROR


class Stacks:
    """Two scheduler + executor pairs; a killed scheduler is replaced by a
    new one over the same executor (it takes the executor over)."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.executors = [ExecutorProcess(model, num_blocks=128) for _ in range(2)]
        self.schedulers = [self._scheduler(i) for i in range(2)]

    def _scheduler(self, i: int) -> Process:
        args = ["scheduler", "--executor", self.executors[i].target, "--port", "0"]
        return Process([*args, "--model", str(self.model)])

    def targets(self) -> list[str]:
        """Both schedulers' targets, live ones (a killed one is restarted)."""
        for i, scheduler in enumerate(self.schedulers):
            if scheduler.process.poll() is not None:
                scheduler.close()
                self.schedulers[i] = self._scheduler(i)
        return [s.target for s in self.schedulers]

    def kill(self, i: int) -> None:
        self.schedulers[i].process.send_signal(signal.SIGKILL)
        self.schedulers[i].process.wait()

    def close(self) -> None:
        for process in [*self.schedulers, *self.executors]:
            process.close()


@pytest.fixture(scope="module")
def stacks(model_dirs: dict[str, Path]) -> Iterator[Stacks]:
    stacks = Stacks(model_dirs["llama"])
    try:
        yield stacks
    finally:
        stacks.close()


def assert_idle(client: Client, target: str) -> None:
    stats = client.stats(target=target)
    assert stats.integrity.ok, stats.integrity.message
    assert stats.num_running == stats.num_waiting == 0
    (executor,) = stats.executors
    assert executor.num_free_blocks == executor.num_usable_blocks


def generate_killing_the_first(
    stacks: Stacks, targets: list[str], **kwargs: Any
) -> tuple[list[GenerateChunk], Client]:
    """Streams one request from a new client of ``targets``, SIGKILLing the
    first target's scheduler (the one serving it) after the first chunk."""
    client = Client(targets, timeout=120)
    chunks = []
    for chunk in client.generate(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True, **kwargs):
        if not chunks:
            assert client.stats(target=targets[0]).num_running == 1
            stacks.kill(0)
        chunks.append(chunk)
    return chunks, client


def assert_one_stream(chunks: list[GenerateChunk], reference: Completion) -> None:
    completion = Completion.from_chunks(chunks)
    assert completion.token_ids == reference.token_ids
    assert completion.text == reference.text
    assert completion.finish_reasons == reference.finish_reasons
    assert completion.usage.prompt_tokens == reference.usage.prompt_tokens
    assert completion.usage.completion_tokens == NUM_TOKENS
    assert len({chunk.request_id for chunk in chunks}) == 1


def test_a_greedy_stream_whose_scheduler_is_killed_completes_on_the_other(
    stacks: Stacks,
) -> None:
    targets = stacks.targets()
    chunks, client = generate_killing_the_first(stacks, targets, temperature=0)
    with client:
        assert client.num_resumes == 1
        reference = client.generate_text(
            PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0
        )  # on the other target: the first is dead
        assert_one_stream(chunks, reference)
        prompt = list(PROMPT.encode())
        assert list(reference.token_ids[0]) == hf_greedy(stacks.model, prompt, NUM_TOKENS)
        assert_idle(client, targets[1])


def test_a_seeded_sample_whose_scheduler_is_killed_completes_on_the_other(
    stacks: Stacks,
) -> None:
    targets = stacks.targets()
    sampling = {"temperature": 0.8, "seed": 42}
    chunks, client = generate_killing_the_first(stacks, targets, **sampling)
    with client:
        assert client.num_resumes == 1
        reference = client.generate_text(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True, **sampling)
        assert_one_stream(chunks, reference)
        assert_idle(client, targets[1])


def test_the_async_client_resumes_too(stacks: Stacks) -> None:
    targets = stacks.targets()

    async def run() -> tuple[list[GenerateChunk], Completion, int]:
        async with AsyncClient(targets, timeout=120) as client:
            chunks: list[GenerateChunk] = []
            stream = client.generate(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0)
            async for chunk in stream:
                if not chunks:
                    stacks.kill(0)
                chunks.append(chunk)
            reference = await client.generate_text(
                PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0
            )
            return chunks, reference, client.num_resumes

    chunks, reference, num_resumes = asyncio.run(run())
    assert num_resumes == 1
    assert_one_stream(chunks, reference)


def test_parallel_samples_are_not_resumed(stacks: Stacks) -> None:
    targets = stacks.targets()
    with Client(targets, timeout=120) as client:
        received = []
        with pytest.raises(UnavailableError):
            stream = client.generate(PROMPT, n=2, max_tokens=NUM_TOKENS, temperature=0)
            for chunk in stream:
                if not received:
                    stacks.kill(0)
                received.append(chunk)
        assert received and not received[-1].is_final
        assert client.num_resumes == 0


# --- scripted schedulers: what a resume sends, and when it happens ------------


@dataclass
class Scripted(scheduler_pb2_grpc.SchedulerServicer):
    """Answers each Generate call with the next step of ``script``: "break"
    (a token, then UNAVAILABLE), "fail" (a final chunk finished ERROR, then
    UNAVAILABLE), a status code name (that status at once) or "finish" (the
    rest of "Hello" and usage). Records the requests."""

    script: list[str]
    requests: list[scheduler_pb2.GenerateRequest] = field(default_factory=list)

    def Generate(self, request: scheduler_pb2.GenerateRequest, context: Any) -> Any:
        self.requests.append(request)
        step = self.script.pop(0)
        done = len(request.resumed_token_ids)
        word = list(b"Hello")
        if step == "break":
            yield scheduler_pb2.GenerateResponse(
                request_id=request.request_id,
                outputs=[
                    scheduler_pb2.SequenceOutput(
                        token_ids=word[done : done + 1], text_delta=chr(word[done])
                    )
                ],
            )
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        if step == "fail":  # as a scheduler that lost its last executor
            yield scheduler_pb2.GenerateResponse(
                request_id=request.request_id,
                outputs=[scheduler_pb2.SequenceOutput(finish_reason=FINISH_ERROR)],
                usage=scheduler_pb2.Usage(prompt_tokens=2, completion_tokens=done),
            )
            context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is available")
        if step != "finish":
            context.abort(grpc.StatusCode[step], f"scripted {step}")
        yield scheduler_pb2.GenerateResponse(
            request_id=request.request_id,
            outputs=[
                scheduler_pb2.SequenceOutput(
                    token_ids=word[done:],
                    text_delta=bytes(word[done:]).decode(),
                    finish_reason=scheduler_pb2.FINISH_REASON_LENGTH,
                )
            ],
            usage=scheduler_pb2.Usage(prompt_tokens=2, completion_tokens=5),
        )


@pytest.fixture
def scripted() -> Iterator[list[tuple[Scripted, str]]]:
    """Two scripted schedulers (their scripts start empty)."""
    servers, made = [], []
    for _ in range(2):
        servicer = Scripted([])
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        made.append((servicer, f"127.0.0.1:{port}"))
    yield made
    for server in servers:
        server.stop(grace=None)


def test_a_resume_sends_the_same_request_with_the_tokens_received(scripted) -> None:
    (first, a), (second, b) = scripted
    first.script = ["break", "ALREADY_EXISTS"]
    second.script = ["break", "finish"]
    with Client(f"{a},{b}", resume=ResumePolicy(backoff_s=0.001)) as client:
        completion = client.generate_text("Hi", max_tokens=5, temperature=0, seed=3)
        assert client.num_resumes == 3
    # a: "H", breaks; b: "e", breaks; a: ALREADY_EXISTS; b: "llo" and usage.
    assert completion.token_ids == (tuple(b"Hello"),)
    assert completion.text == "Hello"
    requests = [*first.requests, *second.requests]
    assert len({r.request_id for r in requests}) == 1 and len(requests[0].request_id) == 32
    assert [list(r.resumed_token_ids) for r in first.requests] == [[], list(b"He")]
    assert [list(r.resumed_token_ids) for r in second.requests] == [list(b"H"), list(b"He")]
    for request in requests:
        assert request.text == "Hi"
        assert (request.sampling.max_tokens, request.sampling.seed) == (5, 3)


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "INTERNAL"])
def test_failures_of_the_request_itself_are_not_retried(scripted, code) -> None:
    (first, a), (second, b) = scripted
    first.script = [code]
    with Client([a, b]) as client, pytest.raises(PagedkvError) as raised:
        client.generate_text("Hi", max_tokens=5)
    assert raised.value.code == grpc.StatusCode[code]
    assert client.num_resumes == 0 and second.requests == []
    first.script = ["ALREADY_EXISTS"]  # on a first call: the caller's id is live
    with Client([a, b]) as client, pytest.raises(AlreadyExistsError):
        client.generate_text("Hi", max_tokens=5, request_id="mine")


def test_a_server_that_stays_away_exhausts_the_bounded_attempts(scripted) -> None:
    (first, a), _ = scripted
    first.script = ["UNAVAILABLE"] * 3
    started = time.monotonic()
    with Client(a, resume=ResumePolicy(max_attempts=2, backoff_s=0.01)) as client:
        with pytest.raises(UnavailableError) as raised:
            client.generate_text("Hi", max_tokens=5)
        assert client.num_resumes == 2
    assert len(first.requests) == 3
    assert "after 2 resumed call(s)" in raised.value.__notes__
    assert time.monotonic() - started < 5


def test_an_invalid_resume_is_raised_not_retried(scripted) -> None:
    (first, a), (second, b) = scripted
    first.script = ["break"]
    second.script = ["INVALID_ARGUMENT"]
    with Client([a, b]) as client, pytest.raises(InvalidArgumentError):
        client.generate_text("Hi", max_tokens=5)
    assert len(second.requests) == 1


def test_a_stream_the_scheduler_ended_itself_is_not_resumed(scripted) -> None:
    (first, a), (second, b) = scripted
    first.script = ["break"]
    second.script = ["fail"]
    with Client([a, b]) as client, pytest.raises(UnavailableError):
        for chunk in client.generate("Hi", max_tokens=5):
            assert not chunk.is_final or chunk.sequences[0].finish_reason == "error"
    assert len(first.requests) == len(second.requests) == 1


def test_the_generate_command_takes_several_targets_and_resumes(
    scripted, capsys: pytest.CaptureFixture[str]
) -> None:
    (first, a), (second, b) = scripted
    for targets in (["--target", f"{a},{b}"], ["--target", a, "--target", b]):
        first.script, second.script = ["break"], ["finish"]
        assert main(["generate", *targets, "--prompt", "Hi", "--max-tokens", "5"]) == 0
        assert capsys.readouterr().out == "Hello\n"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "repeat the flag or separate them with commas" in help_text
    assert "resumes on the next" in help_text
