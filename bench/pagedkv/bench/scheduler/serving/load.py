"""Sends requests at their arrival times and records when each token came.

An open loop: each request is sent at its own time whatever the server's
state (the queue grows when the rate is above what the server sustains), and
its stream is read to the end; every chunk with tokens is timed on arrival.
Greedy sampling with ``ignore_eos``, so each request generates exactly its
``max_tokens``, and ``skip_text`` unless ``text`` is asked for (tokens are
only counted, so the scheduler makes no text, as a client that detokenizes
itself would ask). The raw
Scheduler stub is used (the scheduler side does not
depend on the SDK); a failed call is recorded, never raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pagedkv.bench.scheduler.serving.workload import BenchRequest
from pagedkv.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

REQUEST_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds from the run's start."""

    request_id: str
    prompt_tokens: int  # sent
    cached_prompt_tokens: int  # from the final chunk's usage
    max_tokens: int  # asked for (and expected)
    output_tokens: int  # received
    scheduled_s: float  # its arrival time in the workload
    sent_s: float
    chunk_times_s: tuple[float, ...]  # arrival of each chunk with tokens
    chunk_num_tokens: tuple[int, ...]  # tokens in each of those chunks
    end_s: float
    error: str  # "" when the stream ended with usage

    @property
    def ok(self) -> bool:
        """Ended with usage and exactly the tokens asked for."""
        return not self.error and self.output_tokens == self.max_tokens

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.sent_s if self.chunk_times_s else None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.sent_s


async def _send(
    stub: scheduler_pb2_grpc.SchedulerStub,
    request: BenchRequest,
    scheduled: float,
    start: float,
    text: bool,
) -> RequestResult:
    delay = start + scheduled - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    message = scheduler_pb2.GenerateRequest(
        request_id=request.request_id,
        token_ids=scheduler_pb2.TokenIds(ids=request.prompt_token_ids),
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True
        ),
        skip_text=not text,  # only tokens are counted: no text unless asked for
    )
    sent = time.perf_counter() - start
    times: list[float] = []
    counts: list[int] = []
    usage: scheduler_pb2.Usage | None = None
    error = ""
    try:
        async for chunk in stub.Generate(message, timeout=REQUEST_TIMEOUT_S):
            num = sum(len(output.token_ids) for output in chunk.outputs)
            if num:
                times.append(time.perf_counter() - start)
                counts.append(num)
            if chunk.HasField("usage"):
                usage = chunk.usage
                break
        else:
            error = "the stream ended without usage"
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    return RequestResult(
        request_id=request.request_id,
        prompt_tokens=len(request.prompt_token_ids),
        cached_prompt_tokens=usage.cached_prompt_tokens if usage is not None else 0,
        max_tokens=request.max_tokens,
        output_tokens=sum(counts),
        scheduled_s=scheduled,
        sent_s=sent,
        chunk_times_s=tuple(times),
        chunk_num_tokens=tuple(counts),
        end_s=time.perf_counter() - start,
        error=error,
    )


async def run_load(
    target: str, requests: Sequence[BenchRequest], arrivals: Sequence[float], text: bool = False
) -> tuple[list[RequestResult], float]:
    """Every request's result, in order, and the seconds from the start to
    the last end; with ``text`` the scheduler makes the outputs' text."""
    assert len(requests) == len(arrivals)
    options = [("grpc.max_concurrent_streams", 0)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_send(stub, r, t, start, text) for r, t in zip(requests, arrivals, strict=True))
        )
        seconds = time.perf_counter() - start
    return list(results), seconds


async def wait_ready(target: str, timeout: float = 60.0) -> None:
    """Returns once the scheduler answers GetStats with a healthy executor."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while True:
            try:
                stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
                if any(e.healthy for e in stats.executors):
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no healthy executor behind {target} in {timeout:.0f} s")
            await asyncio.sleep(0.2)


async def server_stats(target: str) -> scheduler_pb2.GetStatsResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        response: scheduler_pb2.GetStatsResponse = await stub.GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10
        )
        return response
