"""Running a generation to its HTTP answer: one JSON object, or a stream of
server-sent events.

A stream's first chunk is awaited before the answer starts, so a request
the scheduler refuses (a prompt too long, a bad value) still gets its HTTP
status (400, 429, 503 ...); after that, a failure ends the stream with one
``data: {"error": ...}`` event. A stream ends with ``data: [DONE]``, after
a usage event when ``stream_options.include_usage``. With
``stream_options.continuous_usage_stats`` every event carries the usage so
far too: the prompt's tokens (counted by the gateway with the model's
tokenizer, as the scheduler counts them) and the tokens generated up to it;
the last usage is the scheduler's own.

A client that goes away cancels the request's gRPC calls, so the scheduler
frees its blocks: a stream's body is cancelled by Starlette on disconnect
(its generator's ``finally`` closes the calls); a request that is not
streamed races its generation against the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedkv.client.types import GenerateChunk
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.metrics import GatewayMetrics
from pagedkv.gateway.streaming import Generation, Update, Usage, dumps

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")


class ResponseFormat(Protocol):
    """An endpoint's response shapes (``CompletionFormat``, ``ChatFormat``)."""

    def event(self, updates: list[Update], extra: bytes = b"") -> bytes | None: ...
    def usage_event(self, usage: Usage) -> bytes: ...
    def collect(self, updates: list[Update]) -> None: ...
    def response(self, usage: Usage) -> dict[str, Any]: ...


class ClientGone(Exception):
    """The client disconnected before the answer started."""


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; ClientGone (``work`` cancelled) if the client goes first."""
    job = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((job, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this task cancelled: so is the work
        job.cancel()
        raise
    finally:
        watch.cancel()
    if not job.done():
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)  # its calls cancelled
        raise ClientGone
    return job.result()


class Exchange:
    """One request's generation and its answer, with its metrics."""

    def __init__(
        self,
        endpoint: str,
        generation: Generation,
        fmt: ResponseFormat,
        metrics: GatewayMetrics,
        started: float,
    ) -> None:
        self.endpoint = endpoint
        self.generation = generation
        self.fmt = fmt
        self.metrics = metrics
        self.started = started
        self._first_text = False

    def _seen(self, updates: list[Update]) -> list[Update]:
        if not self._first_text and any(u.text for u in updates):
            self._first_text = True
            self.metrics.ttft.labels(self.endpoint).observe(time.perf_counter() - self.started)
        return updates

    def _ended(self) -> None:
        """Counts what every request counts once at its end."""
        self.metrics.open_streams.dec()
        elapsed = time.perf_counter() - self.started
        self.metrics.request_seconds.labels(self.endpoint).observe(elapsed)
        self.metrics.output_tokens.labels(self.endpoint).inc(self.generation.num_output_tokens)

    async def whole(self, request: Request) -> Response:
        """The JSON answer once every sequence finished."""
        self.metrics.open_streams.inc()
        try:
            body = await unless_disconnected(request, self._collect())
        except ClientGone:
            self.metrics.disconnects.labels(self.endpoint).inc()
            return Response(status_code=499)
        finally:
            self._ended()
        return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")

    async def _collect(self) -> dict[str, Any]:
        generation = self.generation
        async with contextlib.aclosing(generation.chunks()) as chunks:
            async for prompt_index, chunk in chunks:
                self.fmt.collect(self._seen(generation.updates(prompt_index, chunk)))
        generation.check_complete()
        return self.fmt.response(generation.usage)

    async def stream(
        self, request: Request, include_usage: bool, prompt_tokens: int | None = None
    ) -> Response:
        """The event stream, started once the first chunk came.
        ``prompt_tokens``: put the usage so far on every event (see the
        module docstring); None: only on the usage event, if any."""
        chunks = self.generation.chunks()
        self.metrics.open_streams.inc()
        try:
            first = await unless_disconnected(request, anext(chunks))
        except (ApiError, ClientGone, StopAsyncIteration) as exc:
            await chunks.aclose()
            self._ended()
            if isinstance(exc, ClientGone):
                self.metrics.disconnects.labels(self.endpoint).inc()
                return Response(status_code=499)
            if isinstance(exc, StopAsyncIteration):
                raise ApiError(500, "the stream ended at once", code="internal_error") from None
            raise
        except BaseException:
            await chunks.aclose()
            self._ended()
            raise
        return StreamingResponse(
            self._events(first, chunks, include_usage, prompt_tokens),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    def _event(
        self, prompt_index: int, chunk: GenerateChunk, prompt_tokens: int | None
    ) -> bytes | None:
        updates = self._seen(self.generation.updates(prompt_index, chunk))
        if prompt_tokens is None:
            return self.fmt.event(updates)
        completion_tokens = self.generation.num_output_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return self.fmt.event(updates, b',"usage":' + dumps(usage).encode())

    async def _events(
        self,
        first: tuple[int, GenerateChunk],
        chunks: AsyncGenerator[tuple[int, GenerateChunk], None],
        include_usage: bool,
        prompt_tokens: int | None,
    ) -> AsyncIterator[bytes]:
        generation = self.generation
        completed = False
        try:
            event = self._event(*first, prompt_tokens)
            if event is not None:
                yield event
            async for prompt_index, chunk in chunks:
                event = self._event(prompt_index, chunk, prompt_tokens)
                if event is not None:
                    yield event
            generation.check_complete()
            if include_usage:
                yield self.fmt.usage_event(generation.usage)
            yield DONE
            completed = True
        except ApiError as exc:
            completed = True
            self.metrics.stream_errors.labels(self.endpoint).inc()
            yield exc.sse()
        finally:
            if not completed:
                self.metrics.disconnects.labels(self.endpoint).inc()
            self._ended()
            await chunks.aclose()
