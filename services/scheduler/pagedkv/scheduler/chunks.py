"""A Generate stream's queue of response chunks, built when the stream reads them.

The step loop queues a ``PendingChunk`` per generation with news: plain
references to the tokens, logprobs and finish state of each sequence. The
``GenerateResponse`` message, and the text delta of a sequence that has a
detokenizer, are made when the Generate stream takes the chunk from the
queue (``ChunkQueue.get``), in the stream's own task: neither costs the step
loop anything, and chunks are read in the order they were queued, so every
detokenizer sees its tokens in order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.text import IncrementalDetokenizer
from pagedkv.v1 import scheduler_pb2

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PendingOutput:
    """One sequence's news in a chunk. ``finish_reason`` None: not finished."""

    index: int
    token_ids: list[int]
    logprobs: list[scheduler_pb2.TokenLogprobs]
    detokenizer: IncrementalDetokenizer | None
    finish_reason: int | None = None
    stop_token_id: int | None = None
    error_message: str = ""


@dataclass(frozen=True, slots=True)
class PendingChunk:
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
            text = ""
            detokenizer = pending.detokenizer
            if detokenizer is not None:
                if pending.token_ids:
                    text = detokenizer.push(pending.token_ids)
                if pending.finish_reason is not None:
                    text += detokenizer.flush()
            output = response.outputs.add(
                index=pending.index,
                token_ids=pending.token_ids,
                text_delta=text,
                logprobs=pending.logprobs,
            )
            if pending.finish_reason is not None:
                output.finish_reason = pending.finish_reason  # type: ignore[assignment]
                if pending.stop_token_id is not None:
                    output.stop_token_id = pending.stop_token_id
                output.error_message = pending.error_message
        if self.usage is not None:
            response.usage.CopyFrom(self.usage)
        if self.placement is not None:
            response.placement.CopyFrom(self.placement)
        return response


Item = scheduler_pb2.GenerateResponse | PendingChunk | BaseException


class ChunkQueue(asyncio.Queue[Item]):
    """Chunks (built on the way out), or the error a stream ends with.

    ``get`` and ``get_nowait`` never return a ``PendingChunk``: a chunk whose
    text cannot be made comes out as the INTERNAL error its stream ends with.
    """

    def _get(self) -> Item:
        item = super()._get()
        if not isinstance(item, PendingChunk):
            return item
        try:
            return item.build()
        except Exception as exc:
            log.error("internal error", where="chunk", request_id=item.request_id, exc_info=exc)
            return ServiceError("internal error in the scheduler while making a chunk's text")
