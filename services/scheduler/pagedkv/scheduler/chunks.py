"""A Generate stream's queue of response chunks, built when the stream reads them.

The step loop queues a ``PendingChunk`` per generation with news: plain
references to the tokens, logprobs and finish state of each sequence. The
``GenerateResponse`` message, and the text delta of a sequence that has a
detokenizer, are made when the Generate stream takes the chunk from the
queue (``ChunkQueue.get``), in the stream's own task: neither costs the step
loop anything, and chunks are read in the order they were queued, so every
detokenizer sees its tokens in order.

A Generate stream's messages cost the scheduler's process CPU (some 40-50
us each in gRPC), which the step loop needs: one message per sequence per
step would cost more than the step itself with a few hundred streams. So
chunks queued while a stream is not reading leave as one message, and
streams pace their reads (``ChunkQueue.pause``): after a message, a stream
waits a pace that grows with the number of open streams
(``SchedulerConfig.stream_pace_per_stream``) before reading again. The first
chunk leaves at once, and so does the last (a final chunk or an error ends
the pause).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NamedTuple

from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.common.text import IncrementalDetokenizer
from pagedkv.v1 import scheduler_pb2

log = get_logger(__name__)


class PendingOutput(NamedTuple):
    """One sequence's news in a chunk (``seq_index``: its index in the
    generation). ``finish_reason`` None: not finished. ``text``: text the
    step loop made already (a sequence with stop strings; its detokenizer is
    then None), and ``stop_string`` the one that finished it. A tuple: the
    step loop makes one per sequence with news, and a tuple is the cheapest
    to make."""

    seq_index: int
    token_ids: list[int]
    logprobs: list[scheduler_pb2.TokenLogprobs]
    detokenizer: IncrementalDetokenizer | None
    finish_reason: int | None = None
    stop_token_id: int | None = None
    error_message: str = ""
    text: str = ""
    stop_string: str = ""


class PendingChunk(NamedTuple):
    """A chunk as the step loop leaves it: its outputs, and on the final chunk
    the usage. ``placement`` is set on a generation's first chunk."""

    request_id: str
    outputs: list[PendingOutput]
    usage: scheduler_pb2.Usage | None = None
    placement: scheduler_pb2.Placement | None = None

    def build(self) -> scheduler_pb2.GenerateResponse:
        """The chunk's message; runs each output's detokenizer on its tokens
        (and flushes it on the sequence's last output)."""
        response = scheduler_pb2.GenerateResponse(request_id=self.request_id)
        for pending in self.outputs:
            text = pending.text
            detokenizer = pending.detokenizer
            if detokenizer is not None:
                if pending.token_ids:
                    text += detokenizer.push(pending.token_ids)
                if pending.finish_reason is not None:
                    text += detokenizer.flush()
            output = response.outputs.add(
                index=pending.seq_index,
                token_ids=pending.token_ids,
                text_delta=text,
                logprobs=pending.logprobs,
            )
            if pending.finish_reason is not None:
                output.finish_reason = pending.finish_reason  # type: ignore[assignment]
                if pending.stop_token_id is not None:
                    output.stop_token_id = pending.stop_token_id
                output.error_message = pending.error_message
                output.stop_string = pending.stop_string
        if self.usage is not None:
            response.usage.CopyFrom(self.usage)
        if self.placement is not None:
            response.placement.CopyFrom(self.placement)
        return response


def merge(chunks: list[PendingChunk]) -> PendingChunk:
    """Consecutive chunks of one generation as one: each sequence's tokens,
    logprobs and text in order, its finish from the chunk that has it, the usage
    of the last chunk and the placement of the first."""
    if len(chunks) == 1:
        return chunks[0]
    merged: dict[int, PendingOutput] = {}
    for chunk in chunks:
        for output in chunk.outputs:
            earlier = merged.get(output.seq_index)
            if earlier is None:
                merged[output.seq_index] = output
                continue
            merged[output.seq_index] = PendingOutput(
                output.seq_index,
                earlier.token_ids + output.token_ids,
                earlier.logprobs + output.logprobs,
                output.detokenizer,
                output.finish_reason,
                output.stop_token_id,
                output.error_message,
                earlier.text + output.text,
                output.stop_string,
            )
    first, last = chunks[0], chunks[-1]
    return PendingChunk(first.request_id, list(merged.values()), last.usage, first.placement)


Item = scheduler_pb2.GenerateResponse | PendingChunk | BaseException


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ChunkQueue:
    """Chunks (built on the way out), or the error a stream ends with.

    One writer (the step loop, ``put_nowait``) and one reader (the
    generation's stream, ``get``): a deque and the reader's waiter, without
    ``asyncio.Queue``'s bookkeeping (bounds, several getters and putters,
    ``task_done``), since a put runs once per generation per step.

    ``get`` and ``get_nowait`` never return a ``PendingChunk``: a chunk whose
    text cannot be made comes out as the INTERNAL error its stream ends with.
    Chunks queued behind the one taken leave with it, as one message: a
    stream that reads less often than the steps run gets fewer, larger
    messages (see ``pause``).
    """

    __slots__ = ("_items", "_pause", "_waiter", "closing")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader, waiting in ``get``
        self._pause: asyncio.Future[None] | None = None  # the reader, pausing
        self.closing = False  # a final chunk or an error is queued

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Item) -> None:
        """Queues ``item`` and wakes the reader; a final chunk or an error
        also ends the reader's pause."""
        self._items.append(item)
        if self._waiter is not None:
            _wake(self._waiter)
        if not isinstance(item, PendingChunk) or item.usage is not None:
            self.closing = True
            if self._pause is not None:
                _wake(self._pause)

    async def get(self) -> scheduler_pb2.GenerateResponse | BaseException:
        """The next message (chunks queued together as one) or error, once
        there is one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()

    def get_nowait(self) -> scheduler_pb2.GenerateResponse | BaseException:
        """As ``get``; raises ``asyncio.QueueEmpty`` when nothing is queued."""
        items = self._items
        if not items:
            raise asyncio.QueueEmpty
        item = items.popleft()
        if not isinstance(item, PendingChunk):
            return item
        if items and isinstance(items[0], PendingChunk):
            chunks = [item]
            while items and isinstance(items[0], PendingChunk):
                chunks.append(items.popleft())  # type: ignore[arg-type]
            item = merge(chunks)
        try:
            return item.build()
        except Exception as exc:
            log.error("internal error", where="chunk", request_id=item.request_id, exc_info=exc)
            return ServiceError("internal error in the scheduler while making a chunk's text")

    async def pause(self, seconds: float) -> None:
        """Waits ``seconds``, or less once a final chunk or an error is
        queued: a stream paces its messages with it, so that the chunks of
        the steps in between leave as one."""
        if seconds <= 0 or self.closing:
            return
        loop = asyncio.get_running_loop()
        self._pause = loop.create_future()
        timer = loop.call_later(seconds, _wake, self._pause)
        try:
            await self._pause
        finally:
            timer.cancel()
            self._pause = None
