"""A Generate stream's queue of messages, made when the stream reads them.

The step loop does not make a message per generation per step: it only
marks that a generation has news (``ChunkQueue.put_news``; consecutive marks
are one). The ``GenerateResponse``, with every sequence's tokens, logprobs
and finish since the stream's last message and the text deltas of those
with a detokenizer, is made from the generation's state when the stream
takes the mark (``Generation.take_response``), in the stream's own task:
a step costs the step loop a token appended and a mark, and the stream
makes one message however many steps ran since its last one. Messages are
made in the order the stream reads them, so every detokenizer sees its
tokens in order. A message that must hold the state as it is now (the
state is about to change, ``Generation.flush_now``) is queued made, and
full messages (beam search's) and the error a stream ends with are queued
as they are.

A Generate stream's messages cost the scheduler's process CPU (some 40-50
us each in gRPC), which the step loop needs: one message per sequence per
step would cost more than the step itself with a few hundred streams. So
streams pace their reads (``ChunkQueue.pause``): after a message, a stream
waits a pace that grows with the number of open streams
(``SchedulerConfig.stream_pace_per_stream``) before reading again, and the
news of the steps in between leaves as one message. The first message
leaves at once, and so does the last (a final mark or an error ends the
pause).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.v1 import scheduler_pb2

log = get_logger(__name__)

Message = scheduler_pb2.GenerateResponse | BaseException
_NEWS = object()  # the mark of news: the message is made when it is read


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ChunkQueue:
    """News marks, made messages, or the error a stream ends with.

    One writer (the step loop and the generation's ends) and one reader (the
    generation's stream, ``get``): a deque and the reader's waiter, without
    ``asyncio.Queue``'s bookkeeping (bounds, several getters and putters,
    ``task_done``), since a mark is put once per generation per step.

    ``take``: the generation's ``take_response``, which makes the message of
    a news mark (None when there is no news). ``get`` and ``get_nowait``
    return a message or an error: news whose message cannot be made comes
    out as the INTERNAL error its stream ends with.
    """

    __slots__ = ("_items", "_pause", "_take", "_waiter", "closing", "request_id")

    def __init__(
        self, take: Callable[[], scheduler_pb2.GenerateResponse | None], request_id: str = ""
    ) -> None:
        self._take = take
        self.request_id = request_id  # for the log
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader, waiting in ``get``
        self._pause: asyncio.Future[None] | None = None  # the reader, pausing
        self.closing = False  # the final news, a final message or an error is queued

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def put_news(self, final: bool = False) -> None:
        """Marks news (one mark for news not read yet) and wakes the
        reader; the ``final`` news (the message with usage) also ends the
        reader's pause."""
        items = self._items
        if not items or items[-1] is not _NEWS:
            items.append(_NEWS)
            if self._waiter is not None:
                _wake(self._waiter)
        if final:
            self._close()

    def drop_news(self) -> None:
        """Forgets a news mark at the end of the queue: a message made now
        holds that news."""
        if self._items and self._items[-1] is _NEWS:
            self._items.pop()

    def put_nowait(self, item: Message) -> None:
        """Queues a made message or an error and wakes the reader; an error
        or a message with usage also ends the reader's pause."""
        self._items.append(item)
        if self._waiter is not None:
            _wake(self._waiter)
        if not isinstance(item, scheduler_pb2.GenerateResponse) or item.HasField("usage"):
            self._close()

    def _close(self) -> None:
        self.closing = True
        if self._pause is not None:
            _wake(self._pause)

    async def get(self) -> Message:
        """The next message or error, once there is one."""
        while True:
            while not self._items:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            message = self._next()
            if message is not None:
                return message

    def get_nowait(self) -> Message:
        """As ``get``; raises ``asyncio.QueueEmpty`` when nothing is queued."""
        while self._items:
            message = self._next()
            if message is not None:
                return message
        raise asyncio.QueueEmpty

    def _next(self) -> Message | None:
        item = self._items.popleft()
        if item is not _NEWS:
            return item  # type: ignore[return-value]
        try:
            return self._take()
        except Exception as exc:
            log.error("internal error", where="chunk", request_id=self.request_id, exc_info=exc)
            return ServiceError("internal error in the scheduler while making a chunk's text")

    async def pause(self, seconds: float) -> None:
        """Waits ``seconds``, or less once the final news or an error is
        queued: a stream paces its messages with it, so that the news of
        the steps in between leaves as one message."""
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
