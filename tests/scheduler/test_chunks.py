"""A Generate stream's chunk queue: chunks queued behind the one taken leave
with it as one message, and a stream's pause ends early for its last chunk."""

from __future__ import annotations

import asyncio
import time

from pagedkv.common.errors import ServiceError
from pagedkv.scheduler.chunks import ChunkQueue, PendingChunk, PendingOutput
from pagedkv.v1 import scheduler_pb2

STOP = scheduler_pb2.FinishReason.FINISH_REASON_STOP


def chunk(*outputs: PendingOutput, usage: int | None = None, placed: bool = False) -> PendingChunk:
    return PendingChunk(
        "r",
        list(outputs),
        None if usage is None else scheduler_pb2.Usage(completion_tokens=usage),
        scheduler_pb2.Placement(executor="e0") if placed else None,
    )


def out(index: int, *tokens: int, finish: int | None = None) -> PendingOutput:
    return PendingOutput(index, list(tokens), [], None, finish, 2 if finish else None)


def test_chunks_queued_behind_the_one_taken_leave_as_one_message() -> None:
    async def run() -> scheduler_pb2.GenerateResponse:
        queue = ChunkQueue()
        queue.put_nowait(chunk(out(0, 1), out(1, 7), placed=True))
        queue.put_nowait(chunk(out(0, 2)))
        queue.put_nowait(chunk(out(0, 3), out(1, 8, 9, finish=STOP)))
        item = await queue.get()
        assert queue.empty()
        assert isinstance(item, scheduler_pb2.GenerateResponse)
        return item

    message = asyncio.run(run())
    assert [(o.index, list(o.token_ids)) for o in message.outputs] == [
        (0, [1, 2, 3]),
        (1, [7, 8, 9]),
    ]
    assert message.outputs[1].finish_reason == STOP
    assert message.outputs[1].stop_token_id == 2
    assert message.outputs[0].finish_reason == 0
    assert message.placement.executor == "e0"
    assert not message.HasField("usage")


def test_an_error_is_not_merged_into_the_chunks_before_it() -> None:
    async def run() -> list[object]:
        queue = ChunkQueue()
        queue.put_nowait(chunk(out(0, 1)))
        queue.put_nowait(chunk(out(0, 2), usage=2))
        queue.put_nowait(ServiceError("boom"))
        return [await queue.get(), await queue.get()]

    message, error = asyncio.run(run())
    assert isinstance(message, scheduler_pb2.GenerateResponse)
    assert list(message.outputs[0].token_ids) == [1, 2]
    assert message.usage.completion_tokens == 2
    assert isinstance(error, ServiceError)


def test_a_pause_ends_when_the_last_chunk_is_queued() -> None:
    async def run() -> float:
        queue = ChunkQueue()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, queue.put_nowait, chunk(out(0, 5, finish=STOP), usage=1))
        start = time.monotonic()
        await queue.pause(30.0)
        return time.monotonic() - start

    assert asyncio.run(run()) < 30.0


def test_a_pause_after_the_last_chunk_is_queued_does_not_wait() -> None:
    async def run() -> None:
        queue = ChunkQueue()
        queue.put_nowait(chunk(out(0, 5), usage=1))
        await asyncio.wait_for(queue.pause(30.0), timeout=5.0)

    asyncio.run(run())
