"""``AsyncClient``: the ``grpc.aio`` twin of ``Client``.

The same requests, targets, resuming, chunks and errors
(``pagedkv.client.options`` and ``pagedkv.client.core``); what is here is
the asyncio calling: an ``async for`` over each call, ``asyncio.sleep``
before a resumed one, awaited unary calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from pagedkv.client.core import ClientBase
from pagedkv.client.options import GenerateOptions, generate_request
from pagedkv.client.stats import Stats, stats_from_proto
from pagedkv.client.types import Completion, GenerateChunk
from pagedkv.common.resume import ResumePolicy
from pagedkv.common.security import TlsConfig, open_aio_channel
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only for the type checker


class AsyncClient(ClientBase):
    """An asyncio client of one or several Scheduler replicas (``target`` as
    for ``Client``), resuming broken streams as ``Client`` does.

    The ``grpc.aio`` twin of ``Client``, with the same methods as coroutines
    (``generate`` returns an async iterator). Create it inside the event loop
    that uses it; close it with ``await close()`` or ``async with``.
    ``tls`` and ``token`` as for ``Client``.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = None,
        resume: ResumePolicy | None = None,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(target, timeout=timeout, resume=resume, tls=tls, token=token)
        self._channels = [open_aio_channel(t, tls) for t in self.targets]
        self._stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self._channels]

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channels; calls in flight are cancelled."""
        for channel in self._channels:
            await channel.close()

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGenerator[GenerateChunk, None]:
        """As ``Client.generate``, as an async generator (not a coroutine: use
        ``async for chunk in client.generate(...)``). To stop early, close it
        (``await stream.aclose()``, or ``contextlib.aclosing``): a stream
        merely dropped is closed, and its call cancelled, only once Python
        collects it."""
        return self._stream(generate_request(prompt, **options), timeout)

    def stream_request(
        self, request: scheduler_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[GenerateChunk, None]:
        """As ``generate``, for a ``GenerateRequest`` built by the caller (a
        front that maps another API onto the v1 contract): the same resume,
        errors and cancellation. The request is not checked here; the
        scheduler answers INVALID_ARGUMENT naming the field."""
        return self._stream(request, timeout)

    async def _stream(
        self, request: scheduler_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[GenerateChunk, None]:
        stream = self._open_stream(request, timeout)
        while True:
            call = self._stubs[stream.target_index].Generate(
                stream.request, timeout=stream.timeout(), metadata=stream.metadata
            )
            try:
                async for response in call:
                    yield stream.chunk(response)
                break
            except grpc.RpcError as exc:
                delay_s = stream.retry_delay(exc)
            finally:
                call.cancel()  # a no-op once the call has ended
            await asyncio.sleep(delay_s)
        stream.check_complete()

    async def generate_text(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion:
        """As ``Client.generate_text``."""
        stream = self.generate(prompt, timeout=timeout, **options)
        return Completion.from_chunks([chunk async for chunk in stream])

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """As ``Client.abort``."""
        request = scheduler_pb2.AbortRequest(request_id=request_id)
        outcomes: list[scheduler_pb2.AbortResponse | grpc.RpcError] = []
        for stub in self._stubs:
            try:
                outcomes.append(
                    await stub.Abort(
                        request, timeout=self._deadline(timeout), metadata=self._metadata
                    )
                )
            except grpc.RpcError as exc:
                outcomes.append(exc)
        return self._aborted(outcomes)

    async def stats(
        self,
        *,
        target: str | None = None,
        timeout: float | None = None,
        reset_peak_used_blocks: bool = False,
    ) -> Stats:
        """As ``Client.stats``."""
        index = self._target_index(target)
        try:
            response = await self._stubs[index].GetStats(
                scheduler_pb2.GetStatsRequest(reset_peak_used_blocks=reset_peak_used_blocks),
                timeout=self._deadline(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise self._error(exc, index) from exc
        return stats_from_proto(response)
