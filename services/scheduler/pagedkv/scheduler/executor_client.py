"""The scheduler's connection to one executor (grpc.aio): takeover, the
long-lived step stream, and failure detection.

Any failed or timed-out call raises ``ExecutorDown``; the service then marks
the executor down and moves its sequences elsewhere.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pagedkv.v1 import common_pb2, executor_pb2, executor_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ExecutorDown(Exception):
    """The executor failed, timed out or ended the stream."""


class ExecutorClient:
    """One executor at ``address``; ``connect`` takes it over."""

    def __init__(self, address: str, owner_id: str, *, timeout: float = 60.0) -> None:
        self.address = address
        self.owner = common_pb2.Owner(owner_id=owner_id)
        self.timeout = timeout
        self.info = executor_pb2.GetInfoResponse()
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._stream: Any = None

    async def connect(self) -> executor_pb2.GetInfoResponse:
        """Reads GetInfo and takes the executor over with the next epoch (a
        standalone scheduler is its own lease authority), then opens the step
        stream."""
        try:
            info = await self._stub.GetInfo(executor_pb2.GetInfoRequest(), timeout=self.timeout)
            self.owner.epoch = info.owner.epoch + 1
            await self._stub.Reset(
                executor_pb2.ResetRequest(owner=self.owner), timeout=self.timeout
            )
            info.owner.CopyFrom(self.owner)
            self.info = info
        except grpc.aio.AioRpcError as exc:
            raise ExecutorDown(f"{self.address}: {exc.code().name}: {exc.details()}") from exc
        self._stream = self._stub.StepStream()
        return self.info

    async def step(self, request: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
        """Sends one step on the stream and waits for its response."""
        await self.send(request)
        return await self.receive()

    async def send(self, request: executor_pb2.StepRequest) -> None:
        """Sends a step without waiting for any response (async stepping:
        responses come back in order, one per step)."""
        try:
            if self._stream is None:
                raise ExecutorDown("no step stream")
            await asyncio.wait_for(self._stream.write(request), self.timeout)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, ExecutorDown) as exc:
            self._stream = None
            raise ExecutorDown(f"{self.address}: {exc!r}") from exc

    async def receive(self) -> executor_pb2.StepResponse:
        """The response to the oldest step sent and not yet answered."""
        try:
            return await asyncio.wait_for(self._receive(), self.timeout)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, ExecutorDown) as exc:
            self._stream = None
            raise ExecutorDown(f"{self.address}: {exc!r}") from exc

    async def _receive(self) -> executor_pb2.StepResponse:
        if self._stream is None:
            raise ExecutorDown("no step stream")
        response = await self._stream.read()
        if response is grpc.aio.EOF:
            code = await self._stream.code()
            details = await self._stream.details()
            raise ExecutorDown(f"the step stream ended: {code}: {details}")
        assert isinstance(response, executor_pb2.StepResponse)
        return response

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        await self._channel.close()
