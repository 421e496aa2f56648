"""The scheduler's connection to one executor (grpc.aio): takeover, the
long-lived step stream, and failure detection.

A failed call raises ``ExecutorDown`` with its cause: ``transport`` (the
connection or the stream broke, the executor crashed), ``timeout`` (no answer
within ``timeout`` seconds) or ``refused`` (the executor answered with an
error status: the message was wrong, or another owner holds the executor).
The scheduler decides what each cause means (``step_loop.py``). A step whose
answer takes far longer than the executor's recent steps makes the client
``suspect`` until the answer comes.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Literal

import grpc

from pagedkv.common.ids import MAX_EPOCH, BlockHash, BlockId
from pagedkv.common.logging import get_logger
from pagedkv.common.security import TlsConfig, open_aio_channel
from pagedkv.common.step_contract import MAX_MESSAGE_BYTES
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind
from pagedkv.v1 import common_pb2, executor_pb2, executor_pb2_grpc

log = get_logger(__name__)

SUSPECT_FACTOR = 10.0  # a step this many times its recent maximum is suspect
SUSPECT_FLOOR_S = 1.0  # ... and never before this
PROBE_TIMEOUT_S = 5.0  # for the probes of an executor that is down

Cause = Literal["transport", "timeout", "refused"]

# Statuses by which the executor refuses what it was sent (it is up and
# answered); any other status means the call did not get through.
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class ExecutorDown(Exception):
    """A call to the executor failed; ``cause`` says how, ``detail`` what was
    seen (a status code and its details, never a transport dump)."""

    def __init__(self, cause: Cause, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause: Cause = cause
        self.detail = detail


def _status_cause(code: grpc.StatusCode) -> Cause:
    if code in REFUSALS:
        return "refused"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    return "transport"


def _down(exc: BaseException, address: str, seconds: float) -> ExecutorDown:
    if isinstance(exc, ExecutorDown):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        return ExecutorDown(_status_cause(code), f"{address}: {code.name}: {exc.details()}")
    if isinstance(exc, asyncio.TimeoutError):
        return ExecutorDown("timeout", f"{address}: no answer in {seconds:g} s")
    return ExecutorDown("transport", f"{address}: {type(exc).__name__}: {exc}")


class ExecutorClient:
    """One executor at ``address``; ``connect`` takes it over. ``tls``:
    (mutual) TLS towards it; plaintext without."""

    def __init__(
        self, address: str, owner_id: str, *, timeout: float = 60.0, tls: TlsConfig | None = None
    ) -> None:
        self.address = address
        self.owner = common_pb2.Owner(owner_id=owner_id)
        self.timeout = timeout
        self.info = executor_pb2.GetInfoResponse()
        self._channel = open_aio_channel(
            address,
            tls,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._stream: Any = None
        self.waiting_since: float | None = None  # send time of the step awaited now
        self.recent: deque[float] = deque(maxlen=32)  # recent steps' round trips (s)

    async def get_info(self, timeout: float | None = None) -> executor_pb2.GetInfoResponse:
        """The executor's GetInfo (read-only; no owner needed)."""
        seconds = self.timeout if timeout is None else timeout
        try:
            info = await self._stub.GetInfo(executor_pb2.GetInfoRequest(), timeout=seconds)
        except grpc.aio.AioRpcError as exc:
            raise _down(exc, self.address, seconds) from exc
        assert isinstance(info, executor_pb2.GetInfoResponse)
        return info

    async def connect(
        self,
        info: executor_pb2.GetInfoResponse | None = None,
        *,
        epoch: int | None = None,
        drop_cached_blocks: bool = False,
    ) -> executor_pb2.GetInfoResponse:
        """Takes the executor over, then opens the step stream (a stream
        still open is dropped first). ``info``: a GetInfo just read (read
        again otherwise). ``epoch``: the one a lease granted; by default the
        epoch after the executor's current one (a standalone scheduler is its
        own lease authority). ``drop_cached_blocks``: also drop its block
        tags (start cold)."""
        self._drop_stream()
        if info is None:
            info = await self.get_info()
        if epoch is None:
            if info.owner.epoch >= MAX_EPOCH:
                raise ExecutorDown(
                    "refused",
                    f"{self.address}: its epoch {info.owner.epoch} is the maximum; restart it",
                )
            epoch = info.owner.epoch + 1
        self.owner.epoch = epoch
        request = executor_pb2.ResetRequest(owner=self.owner, drop_cached_blocks=drop_cached_blocks)
        try:
            await self._stub.Reset(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _down(exc, self.address, self.timeout) from exc
        info.owner.CopyFrom(self.owner)
        self.info = info
        self._stream = self._stub.StepStream()
        return self.info

    async def list_cached_blocks(self) -> tuple[list[CacheEvent], list[CacheEvent]]:
        """The executor's tagged blocks, oldest first, and its host tier's
        (block ids there are host block ids); right after ``connect``: only
        the current owner may list them."""
        request = executor_pb2.ListCachedBlocksRequest(owner=self.owner)
        cached: list[CacheEvent] = []
        on_host: list[CacheEvent] = []
        stored = CacheEventKind.STORED
        try:
            async for chunk in self._stub.ListCachedBlocks(request, timeout=self.timeout):
                for into, columns in (
                    (cached, (chunk.block_ids, chunk.block_hashes, chunk.group_ids)),
                    (
                        on_host,
                        (chunk.host_block_ids, chunk.host_block_hashes, chunk.host_group_ids),
                    ),
                ):
                    into.extend(
                        CacheEvent(stored, BlockId(b), BlockHash(h), g)
                        for b, h, g in zip(*columns, strict=True)
                    )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an executor without tags
                log.warning("executor lists no cached blocks", executor=self.address)
                return [], []
            raise _down(exc, self.address, self.timeout) from exc
        return cached, on_host

    def owned_by_us(self, info: executor_pb2.GetInfoResponse) -> bool:
        """Whether ``info`` shows this client's owner and epoch."""
        return (info.owner.owner_id, info.owner.epoch) == (self.owner.owner_id, self.owner.epoch)

    async def step(self, request: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
        """Sends one step on the stream and waits for its response."""
        await self.send(request)
        return await self.receive()

    async def send(self, request: executor_pb2.StepRequest) -> None:
        """Sends a step without waiting for any response (async stepping:
        responses come back in order, one per step)."""
        stream = self._stream
        try:
            if stream is None:
                raise ExecutorDown("transport", f"{self.address}: no step stream")
            await asyncio.wait_for(stream.write(request), self.timeout)
        except (asyncio.TimeoutError, ExecutorDown) as exc:
            self._drop_stream()
            raise _down(exc, self.address, self.timeout) from exc
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # A write fails once the stream has ended; its status says why.
            down = await self._ended(stream)
            self._drop_stream()
            raise down from exc

    async def _ended(self, stream: Any) -> ExecutorDown:
        """Why a step stream that gives no more responses has ended (its status)."""
        try:
            code = await asyncio.wait_for(stream.code(), PROBE_TIMEOUT_S)
            details = await asyncio.wait_for(stream.details(), PROBE_TIMEOUT_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):
            return ExecutorDown("transport", f"{self.address}: the step stream ended")
        detail = f"{self.address}: the step stream ended: {code.name}: {details}"
        return ExecutorDown(_status_cause(code), detail)

    @property
    def suspect_after(self) -> float:
        """Seconds after which an unanswered step makes the executor suspect."""
        recent = max(self.recent, default=0.0)
        return max(SUSPECT_FLOOR_S, SUSPECT_FACTOR * recent)

    @property
    def suspect(self) -> bool:
        """Whether the step awaited now has run far longer than recent steps."""
        since = self.waiting_since
        return since is not None and time.monotonic() - since > self.suspect_after

    async def receive(self, sent_at: float | None = None) -> executor_pb2.StepResponse:
        """The response to the oldest step sent and not yet answered;
        ``sent_at`` (time.monotonic) is when that step was sent (default: now).
        Raises ExecutorDown once ``timeout`` seconds have passed since then."""
        start = time.monotonic() if sent_at is None else sent_at
        self.waiting_since = start
        read = asyncio.ensure_future(self._receive())
        try:
            if self.suspect_after < self.timeout:
                done, _ = await asyncio.wait({read}, timeout=self._left(start, self.suspect_after))
                if not done:
                    log.warning(
                        "executor step is slow",
                        executor=self.address,
                        seconds=round(time.monotonic() - start, 3),
                        timeout=self.timeout,
                    )
            done, _ = await asyncio.wait({read}, timeout=self._left(start, self.timeout))
            if not done:
                raise asyncio.TimeoutError
            response = read.result()
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, ExecutorDown) as exc:
            self._drop_stream()
            raise _down(exc, self.address, self.timeout) from exc
        finally:
            read.cancel()
            self.waiting_since = None
        self.recent.append(time.monotonic() - start)
        return response

    @staticmethod
    def _left(start: float, seconds: float) -> float:
        return max(0.0, start + seconds - time.monotonic())

    async def _receive(self) -> executor_pb2.StepResponse:
        if self._stream is None:
            raise ExecutorDown("transport", f"{self.address}: no step stream")
        response = await self._stream.read()
        if response is grpc.aio.EOF:
            raise await self._ended(self._stream)
        assert isinstance(response, executor_pb2.StepResponse)
        return response

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    async def close(self) -> None:
        self._drop_stream()
        await self._channel.close()
