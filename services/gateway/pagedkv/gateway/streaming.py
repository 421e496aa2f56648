"""One OpenAI request's gRPC streams, as the choices' updates.

A request with P prompts and ``n`` runs P Generate streams (one per prompt,
``n`` inside each); choice ``prompt_index * n + sequence index``.
``Generation.updates`` turns each gRPC chunk into ``Update``s (one per
sequence with news), sums the usage of the streams, and raises ``ApiError``
for a sequence the scheduler aborted (503: it is stopping) or failed.

Closing the iterator of ``Generation.chunks`` (a client gone, an error)
cancels every gRPC call it started, so the scheduler frees their blocks.
Nothing here copies text beyond what the response needs: each update
carries the chunk's text delta as the scheduler sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Sequence
from json.encoder import encode_basestring
from typing import NamedTuple

from pagedkv.client import AsyncClient
from pagedkv.client.errors import PagedkvError
from pagedkv.client.types import FinishReason, GenerateChunk, TokenLogprob
from pagedkv.gateway.errors import RETRY_AFTER_S, ApiError, from_pagedkv
from pagedkv.v1 import scheduler_pb2

OPENAI_FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.EOS: "stop",
}
"""Finish reasons as OpenAI names them; ABORT and ERROR end with an error."""

FINISH_JSON: dict[str | None, bytes] = {None: b"null", "length": b'"length"', "stop": b'"stop"'}
"""A choice's ``finish_reason`` as JSON."""

dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""Compact JSON, non-ASCII characters as they are (the body is UTF-8)."""


def json_text(text: str) -> bytes:
    """``text`` as a JSON string, UTF-8 (the C encoder, no dict around it)."""
    return encode_basestring(text).encode()


class Update(NamedTuple):
    """What one choice got from one gRPC chunk."""

    choice: int
    """The choice's index in the response."""
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Generation:
    """The streams of one request and what they have produced so far.

    ``prompt_param`` names the prompt in errors ("prompt" or "messages").
    Mutated by ``updates`` only; ``usage`` is complete once ``chunks`` ended.
    """

    def __init__(
        self,
        client: AsyncClient,
        requests: Sequence[scheduler_pb2.GenerateRequest],
        n: int,
        prompt_param: str = "prompt",
        timeout: float | None = None,
    ) -> None:
        self.client = client
        self.requests = requests
        self.n = n
        self.prompt_param = prompt_param
        self.timeout = timeout
        self.num_choices = n * len(requests)
        self.num_finished = 0
        self.num_output_tokens = 0
        self._usage = [0, 0, 0]

    @property
    def usage(self) -> Usage:
        return Usage(*self._usage)

    def updates(self, prompt_index: int, chunk: GenerateChunk) -> list[Update]:
        """The choices' news in ``chunk`` of prompt ``prompt_index``'s stream."""
        out = []
        base = prompt_index * self.n
        for seq in chunk.sequences:
            reason = seq.finish_reason
            finish = None
            if reason is not None:
                if reason is FinishReason.ABORT:
                    raise ApiError(
                        503,
                        "the request was aborted: the scheduler is stopping",
                        code="service_unavailable",
                        retry_after=RETRY_AFTER_S,
                    )
                if reason is FinishReason.ERROR:
                    message = seq.error_message or "the request failed"
                    raise ApiError(500, message, code="internal_error")
                finish = OPENAI_FINISH[reason]
                self.num_finished += 1
            self.num_output_tokens += len(seq.token_ids)
            out.append(Update(base + seq.index, seq.text, seq.token_ids, seq.logprobs, finish))
        usage = chunk.usage
        if usage is not None:
            self._usage[0] += usage.prompt_tokens
            self._usage[1] += usage.completion_tokens
            self._usage[2] += usage.cached_prompt_tokens
        return out

    async def chunks(self) -> AsyncGenerator[tuple[int, GenerateChunk], None]:
        """(prompt index, chunk) as the streams deliver them. Raises
        ``ApiError`` for a failed call; closing the iterator cancels them all."""
        try:
            if len(self.requests) == 1:
                stream = self.client.stream_request(self.requests[0], timeout=self.timeout)
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        yield 0, chunk
            else:
                async with contextlib.aclosing(self._merged()) as merged:
                    async for item in merged:
                        yield item
        except PagedkvError as exc:
            raise from_pagedkv(exc, self.prompt_param) from exc

    async def _merged(self) -> AsyncGenerator[tuple[int, GenerateChunk], None]:
        """Every stream's chunks, interleaved as they arrive (one task each)."""
        queue: asyncio.Queue[tuple[int, GenerateChunk | None, Exception | None]]
        queue = asyncio.Queue()

        async def pump(index: int, request: scheduler_pb2.GenerateRequest) -> None:
            try:
                stream = self.client.stream_request(request, timeout=self.timeout)
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        queue.put_nowait((index, chunk, None))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait((index, None, exc))
            else:
                queue.put_nowait((index, None, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.requests)]
        try:
            remaining = len(tasks)
            while remaining:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    remaining -= 1
                    continue
                yield index, chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def check_complete(self) -> None:
        """Raises when the streams ended with a choice unfinished."""
        if self.num_finished < self.num_choices:
            raise ApiError(
                500, "a stream ended before its sequences finished", code="internal_error"
            )
