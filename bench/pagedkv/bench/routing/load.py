"""Sends a trace through a router at a fixed concurrency and records each request.

``concurrency`` streams each take the next request of the trace as soon as
their previous one ends (a closed loop: the load stays the same whatever
the policy, and no policy is measured at a queue that only grows). The raw
Scheduler stub is used because the first chunk's ``placement`` (which
executor, what became of the router's hint) is not in the SDK's chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pagedkv.bench.routing.trace import TraceRequest
from pagedkv.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's outcome, as the client saw it (times from the trace's start)."""

    request_id: str
    prefix_index: int
    sent_s: float
    ttft_s: float | None  # send to the first chunk with tokens
    end_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    executor: str  # from the first chunk's placement ("" when none came)
    hint: str  # honoured, not_held, draining or none
    error: str  # "" when the stream ended with usage

    @property
    def finished(self) -> bool:
        return not self.error

    @property
    def computed_prompt_tokens(self) -> int:
        """Prefill tokens computed: the prompt less what the prefix cache had."""
        return self.prompt_tokens - self.cached_prompt_tokens


def _hint_name(hint: int) -> str:
    return scheduler_pb2.PlacementHint.Name(hint).removeprefix("PLACEMENT_HINT_").lower()


async def _send(
    stub: scheduler_pb2_grpc.SchedulerStub, request: TraceRequest, start: float
) -> RequestRecord:
    message = scheduler_pb2.GenerateRequest(
        request_id=request.request_id,
        token_ids=scheduler_pb2.TokenIds(ids=request.token_ids),
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True
        ),
    )
    sent = time.perf_counter()
    ttft: float | None = None
    executor, hint, error = "", "none", ""
    usage = scheduler_pb2.Usage()
    try:
        async for chunk in stub.Generate(message, timeout=REQUEST_TIMEOUT_S):
            if chunk.HasField("placement"):
                executor, hint = chunk.placement.executor, _hint_name(chunk.placement.hint)
            if ttft is None and any(output.token_ids for output in chunk.outputs):
                ttft = time.perf_counter() - sent
            if chunk.HasField("usage"):
                usage = chunk.usage
                break
        else:
            error = "the stream ended without usage"
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    return RequestRecord(
        request_id=request.request_id,
        prefix_index=request.prefix_index,
        sent_s=sent - start,
        ttft_s=ttft,
        end_s=time.perf_counter() - start,
        prompt_tokens=usage.prompt_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        completion_tokens=usage.completion_tokens,
        executor=executor,
        hint=hint,
        error=error,
    )


async def run_trace(
    router: str, requests: Sequence[TraceRequest], concurrency: int
) -> tuple[list[RequestRecord], float]:
    """Every request's record, in trace order, and the seconds from the first
    send to the last end."""
    records: list[RequestRecord | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))
    async with grpc.aio.insecure_channel(router) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        start = time.perf_counter()

        async def stream() -> None:
            for i in next_index:
                records[i] = await _send(stub, requests[i], start)

        await asyncio.gather(*(stream() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    done = [r for r in records if r is not None]
    assert len(done) == len(requests)
    return done, seconds


async def router_stats(router: str) -> scheduler_pb2.GetStatsResponse:
    """The router's GetStats: its schedulers' executors, summed counts, its state."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        response: scheduler_pb2.GetStatsResponse = await stub.GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10
        )
        return response
