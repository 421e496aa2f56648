"""Faults stay contained: client request ids shaped like the scheduler's own
names, bugs in the scheduler's code, executors that hang, are taken over or
restart (and come back), all against real processes."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest

from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import configure_logging
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.entry_writer import EntryWriter
from pagedkv.scheduler.sequence import Sequence
from pagedkv.scheduler.service import SchedulerService
from pagedkv.v1 import common_pb2, executor_pb2, scheduler_pb2
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import hf_greedy, model_dirs
from tests.service.stack import Process, serve
from tests.service.test_stack import assert_nothing_held, greedy_request

__all__ = ["model_dirs"]

FinishReason = scheduler_pb2.FinishReason
PROMPT = list(b"forty-eight tokens of prompt, in three blocks...")  # 48 tokens
assert len(PROMPT) == 48


def sampled_request(request_id: str, n: int, max_tokens: int) -> scheduler_pb2.GenerateRequest:
    request = greedy_request(PROMPT, max_tokens, request_id=request_id)
    request.sampling.n = n
    return request


def tokens_of(chunks: list[scheduler_pb2.GenerateResponse]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for chunk in chunks:
        for output in chunk.outputs:
            tokens.setdefault(output.index, []).extend(output.token_ids)
    return tokens


def wait_for(stub, condition, seconds: float = 120.0) -> scheduler_pb2.GetStatsResponse:
    """Polls GetStats until ``condition(stats)`` holds (fails after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        stats = stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
        if condition(stats):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


@pytest.fixture(scope="module")
def single(model_dirs: dict[str, Path]):
    """pagedkv serve with one executor: every request lands on the same pool."""
    with serve(model_dirs["llama"], executors=1, num_blocks=128) as process:
        yield process


@pytest.mark.parametrize(
    ("first", "second"),
    [("col", "col/1"), ("col/1", "col"), ("x", "x/0"), ("b", "b/beam1")],
)
def test_request_ids_shaped_like_sample_names_are_just_ids(
    single, model_dirs, first: str, second: str
) -> None:
    expected = hf_greedy(model_dirs["llama"], PROMPT, 40)
    running = single.stub.Generate(sampled_request(first, 2, 40), timeout=300)
    head = next(running)  # the first request runs while the second arrives
    other = list(single.stub.Generate(sampled_request(second, 1, 40), timeout=300))
    rest = [head, *running]
    for chunks, request_id, n in ((rest, first, 2), (other, second, 1)):
        assert {c.request_id for c in chunks} == {request_id}
        assert tokens_of(chunks) == dict.fromkeys(range(n), expected)
        assert chunks[-1].HasField("usage")
    stats = wait_for(single.stub, lambda s: s.num_running == 0)
    assert [e.healthy for e in stats.executors] == [True]
    assert_nothing_held(single.stub)


def test_a_request_id_over_256_bytes_is_invalid(single) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(single.stub.Generate(greedy_request(PROMPT, 2, request_id="é" * 129), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in (info.value.details() or "")
    chunks = list(single.stub.Generate(greedy_request(PROMPT, 2, request_id="é" * 128)))
    assert chunks[-1].request_id == "é" * 128


# -- bugs in the scheduler's own code -------------------------------------------


async def _drain(generation) -> tuple[list[scheduler_pb2.GenerateResponse], ServiceError | None]:
    """A generation's chunks up to its final one, and the error status after it."""
    chunks: list[scheduler_pb2.GenerateResponse] = []
    while True:
        item = await asyncio.wait_for(generation.chunks.get(), 120)
        if isinstance(item, ServiceError):
            return chunks, item
        chunks.append(item)
        if item.HasField("usage"):
            await asyncio.sleep(0)
            error = None if generation.chunks.empty() else generation.chunks.get_nowait()
            assert error is None or isinstance(error, ServiceError)
            return chunks, error


# Per-sequence calls of a step: applying a sample (the stop check) and
# building the step (an entry's state changes).
FAULTS = {
    "apply": (Sequence, "stop_reason"),
    "build": (EntryWriter, "_commit"),
}


def _inject(monkeypatch, where: str, request_id: str, after_tokens: int) -> None:
    """Makes the per-sequence call ``where`` (see FAULTS) raise for the
    generation ``request_id`` once it has ``after_tokens`` output tokens."""
    owner, method = FAULTS[where]
    original = getattr(owner, method)

    def broken(self, *args, **kwargs):
        seq = self if isinstance(self, Sequence) else args[0]
        if (
            seq.generation.request_id == request_id
            and seq.request.num_output_tokens >= after_tokens
        ):
            raise RuntimeError(f"injected fault in {method}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, broken)


@pytest.mark.parametrize("where", sorted(FAULTS))
def test_a_scheduler_bug_fails_only_the_requests_it_concerns(
    model_dirs, monkeypatch, where: str
) -> None:
    """A fault while applying samples or while building a step ends that
    request with FINISH_REASON_ERROR and INTERNAL; the other request finishes
    with Hugging Face's output and the executor stays in service."""
    model = model_dirs["llama"]
    expected = hf_greedy(model, PROMPT, 24)
    _inject(monkeypatch, where, "boom", 3)
    configure_logging("console", "INFO")  # onto this test's stderr, not an earlier one's

    async def main(target: str) -> None:
        config = SchedulerConfig(executors=(target,), model_dir=str(model))
        service = SchedulerService(config)
        await service.start()
        try:
            boom = service.submit(sampled_request("boom", 1, 24))
            fine = service.submit(sampled_request("fine", 1, 24))
            (boom_chunks, boom_error), (fine_chunks, fine_error) = await asyncio.gather(
                _drain(boom), _drain(fine)
            )
            assert fine_error is None
            assert tokens_of(fine_chunks) == {0: expected}
            assert boom_error is not None and boom_error.code == grpc.StatusCode.INTERNAL
            final = boom_chunks[-1].outputs[-1]
            assert final.finish_reason == FinishReason.FINISH_REASON_ERROR
            assert "internal error" in final.error_message
            stats = service.stats()
            assert stats.num_internal_errors == 1
            assert [e.healthy for e in stats.executors] == [True]
            assert stats.integrity.ok, stats.integrity.message
            assert stats.num_running == stats.num_waiting == 0
            held = stats.executors[0].num_usable_blocks - stats.executors[0].num_free_blocks
            assert held == 0
            # Still serving: a new request after the fault.
            again, error = await _drain(service.submit(sampled_request("again", 1, 24)))
            assert error is None and tokens_of(again) == {0: expected}
        finally:
            await service.stop()

    with ExecutorProcess(model, num_blocks=64) as executor:
        asyncio.run(main(executor.target))


# -- executors that hang, are taken over, or restart ----------------------------


def _scheduler(target: str, model: Path, timeout: float = 4.0) -> Process:
    args = ["scheduler", "--executor", target, "--port", "0", "--model", str(model)]
    return Process([*args, "--executor-timeout", str(timeout)])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_hung_executor_is_suspect_then_down_then_comes_back(model_dirs) -> None:
    model = model_dirs["llama"]
    expected = hf_greedy(model, PROMPT, 16)
    with (
        ExecutorProcess(model, num_blocks=64) as executor,
        _scheduler(executor.target, model) as scheduler,
    ):
        stub = scheduler.stub
        assert tokens_of(list(stub.Generate(greedy_request(PROMPT, 16), timeout=120))) == {
            0: expected
        }
        executor.process.send_signal(signal.SIGSTOP)
        try:
            call = stub.Generate(greedy_request(PROMPT, 400), timeout=300)
            stats = wait_for(stub, lambda s: s.executors[0].suspect)
            assert stats.executors[0].healthy
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            stats = stub.GetStats(scheduler_pb2.GetStatsRequest())
            assert not stats.executors[0].healthy
            assert stats.executors[0].down_reason.startswith("timeout:")
        finally:
            executor.process.send_signal(signal.SIGCONT)
        stats = wait_for(stub, lambda s: s.executors[0].healthy)
        assert stats.executors[0].num_recoveries == 1
        assert not stats.executors[0].suspect and not stats.executors[0].down_reason
        chunks = list(stub.Generate(greedy_request(PROMPT, 16), timeout=120))
        assert tokens_of(chunks) == {0: expected}
        assert_nothing_held(stub)


def test_a_restarted_executor_is_taken_as_a_new_one(model_dirs) -> None:
    model = model_dirs["llama"]
    expected = hf_greedy(model, PROMPT, 16)
    port = ("--port", str(_free_port()))
    first = ExecutorProcess(model, num_blocks=64, extra_args=port)
    with first, _scheduler(first.target, model) as scheduler:
        stub = scheduler.stub
        before = stub.GetStats(scheduler_pb2.GetStatsRequest()).executors[0].incarnation_id
        call = stub.Generate(greedy_request(PROMPT, 400), timeout=300)
        chunks = [next(call)]
        first.process.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            chunks.extend(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        final = chunks[-1].outputs[-1]
        assert final.finish_reason == FinishReason.FINISH_REASON_ERROR
        assert final.error_message.startswith("every executor is down (transport:")
        down = stub.GetStats(scheduler_pb2.GetStatsRequest()).executors[0]
        assert not down.healthy and down.down_reason.startswith("transport:")
        for text in (info.value.details(), final.error_message, down.down_reason):
            assert "debug_error_string" not in text and "AioRpcError" not in text
        with ExecutorProcess(model, num_blocks=64, extra_args=port):
            stats = wait_for(stub, lambda s: s.executors[0].healthy)
            assert stats.executors[0].incarnation_id != before
            assert stats.executors[0].num_recoveries == 1
            chunks = list(stub.Generate(greedy_request(PROMPT, 16), timeout=120))
            assert tokens_of(chunks) == {0: expected}
            assert_nothing_held(stub)


def test_an_executor_taken_over_by_another_owner_is_not_taken_back(model_dirs) -> None:
    model = model_dirs["llama"]
    with (
        ExecutorProcess(model, num_blocks=64) as executor,
        _scheduler(executor.target, model) as scheduler,
    ):
        stub = scheduler.stub
        call = stub.Generate(greedy_request(PROMPT, 400), timeout=300)
        next(call)
        info = executor.stub.GetInfo(executor_pb2.GetInfoRequest())
        owner = common_pb2.Owner(owner_id="another", epoch=info.owner.epoch + 1)
        executor.stub.Reset(executor_pb2.ResetRequest(owner=owner))
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        stats = wait_for(stub, lambda s: not s.executors[0].healthy)
        assert stats.executors[0].down_reason.startswith("fenced:")
        time.sleep(2.0)  # several probes: the executor stays the other owner's
        after = executor.stub.GetInfo(executor_pb2.GetInfoRequest()).owner
        assert after == owner
        stats = stub.GetStats(scheduler_pb2.GetStatsRequest())
        assert not stats.executors[0].healthy and stats.executors[0].num_recoveries == 0
