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
frees its blocks: one ``Watch`` per request waits for the disconnect, and
the generation (the whole answer, a stream's first chunk, then its body)
races it; a stream's body cancelled, its generator's ``finally`` closes
the calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedkv.client.types import GenerateChunk
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.metrics import GatewayMetrics
from pagedkv.gateway.streaming import FINISH_JSON, Generation, Update, Usage, dumps

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ChoicesFormat:
    """The shapes of one response with ``num_choices`` choices, streamed or
    not (``CompletionFormat``, ``ChatFormat``): for a response that is not
    streamed, ``collect`` every update, then ``response``; for a stream,
    ``event`` per chunk and ``usage_event``.

    A stream event is built as bytes around a head serialized once per
    request (id, object, created, model), so it costs the JSON encoding of
    its texts (and logprobs, when asked for). A subclass names its objects
    and says what a choice is: ``_event_choice`` (one update's part of an
    event), ``_collect_logprobs`` and ``_choice`` (a whole choice).
    """

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, created: int, model: str, num_choices: int) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self._head = (
            f'data: {{"id":{dumps(request_id)},"object":"{self.chunk_object_name}",'
            f'"created":{created},"model":{dumps(model)},"choices":'
        ).encode()
        self._texts: list[list[str]] = [[] for _ in range(num_choices)]
        self._finish: list[str | None] = [None] * num_choices

    def _event_choice(self, update: Update, finish: bytes) -> bytes:
        raise NotImplementedError

    def _collect_logprobs(self, update: Update) -> None:
        raise NotImplementedError

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def event(self, updates: list[Update], extra: bytes = b"") -> bytes | None:
        """The SSE event of one chunk's updates; None when it says nothing.
        ``extra``: more members of the event's object (``,"usage":{...}``)."""
        parts = [
            self._event_choice(u, FINISH_JSON[u.finish_reason])
            for u in updates
            if u.text or u.finish_reason or u.logprobs
        ]
        if not parts:
            return None
        return self._head + b"[" + b",".join(parts) + b"]" + extra + b"}\n\n"

    def usage_event(self, usage: Usage) -> bytes:
        return self._head + b'[],"usage":' + dumps(usage.as_dict()).encode() + b"}\n\n"

    def collect(self, updates: list[Update]) -> None:
        """Adds ``updates`` to the response that is not streamed."""
        for u in updates:
            self._texts[u.choice].append(u.text)
            if u.finish_reason is not None:
                self._finish[u.choice] = u.finish_reason
            self._collect_logprobs(u)

    def response(self, usage: Usage) -> dict[str, Any]:
        """The whole response object."""
        return {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [
                self._choice(i, "".join(texts), self._finish[i])
                for i, texts in enumerate(self._texts)
            ],
            "usage": usage.as_dict(),
        }


class ClientGone(Exception):
    """The client disconnected before the answer started."""


class Watch:
    """Whether one request's client went away: a single task, started once
    the request's body is read, that ends when the server says
    ``http.disconnect``. Every wait of the request (its first chunk, the
    whole answer, the stream's body) races it; ``close`` ends it."""

    def __init__(self, receive: Receive) -> None:
        self.task = asyncio.ensure_future(self._disconnect(receive))

    @staticmethod
    async def _disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def race(self, work: Awaitable[T]) -> T:
        """``work``'s result; ClientGone (``work`` cancelled) if the client goes first."""
        job = asyncio.ensure_future(work)
        try:
            await asyncio.wait((job, self.task), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task cancelled: so is the work
            job.cancel()
            raise
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)  # its calls cancelled
            raise ClientGone
        return job.result()

    def close(self) -> None:
        self.task.cancel()


class EventStream(StreamingResponse):
    """A stream of server-sent events that sends itself straight to the
    server: each event as it comes, the last (``data: [DONE]``) together
    with the body's end; the client going (its ``watch``) cancels it, and
    with it the request's gRPC calls."""

    def __init__(self, events: AsyncIterator[bytes], watch: Watch) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.watch = watch

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(self._send_body(send))
        try:
            await asyncio.wait((body, self.watch.task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.watch.close()
            if not body.done():
                body.cancel()
                await asyncio.gather(body, return_exceptions=True)
        if not body.cancelled():
            body.result()  # its error, if any

    async def _send_body(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        last = b""
        async for chunk in self.body_iterator:
            if last:
                await send({"type": "http.response.body", "body": last, "more_body": True})
                last = b""
            assert isinstance(chunk, bytes)  # the events of ``Exchange``
            if chunk == DONE:
                last = chunk  # sent with the body's end
                continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": last, "more_body": False})


class Exchange:
    """One request's generation and its answer, with its metrics."""

    def __init__(
        self,
        endpoint: str,
        generation: Generation,
        fmt: ChoicesFormat,
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
        watch = Watch(request.receive)
        try:
            body = await watch.race(self._collect())
        except ClientGone:
            self.metrics.disconnects.labels(self.endpoint).inc()
            return Response(status_code=499)
        finally:
            watch.close()
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
        watch = Watch(request.receive)
        try:
            first = await watch.race(anext(chunks))
        except (ApiError, ClientGone, StopAsyncIteration) as exc:
            watch.close()
            await chunks.aclose()
            self._ended()
            if isinstance(exc, ClientGone):
                self.metrics.disconnects.labels(self.endpoint).inc()
                return Response(status_code=499)
            if isinstance(exc, StopAsyncIteration):
                raise ApiError(500, "the stream ended at once", code="internal_error") from None
            raise
        except BaseException:
            watch.close()
            await chunks.aclose()
            self._ended()
            raise
        return EventStream(self._events(first, chunks, include_usage, prompt_tokens), watch)

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
