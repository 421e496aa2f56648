"""The Executor gRPC service: ``ExecutorServicer``, its error interceptor and
the server around them (with gRPC health and reflection; an undecodable
request is INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedkv.common.errors import ServiceError
from pagedkv.common.ports import GRPC_SERVER_OPTIONS, ListenError
from pagedkv.common.request_decoding import RequestDecodingInterceptor
from pagedkv.common.server_security import ServerSecurity, bind, start_health_server
from pagedkv.common.step_contract import MAX_MESSAGE_BYTES
from pagedkv.executor.engine import Executor
from pagedkv.executor.step_pipeline import StepPipeline
from pagedkv.v1 import executor_pb2, executor_pb2_grpc

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Thin: every call goes to the ``Executor``; errors become statuses in
    ``ErrorInterceptor``."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def GetInfo(self, request: Any, context: Any) -> executor_pb2.GetInfoResponse:
        return self.executor.get_info()

    def Allocate(self, request: Any, context: Any) -> executor_pb2.AllocateResponse:
        return self.executor.allocate(request)

    def Free(self, request: Any, context: Any) -> executor_pb2.FreeResponse:
        return self.executor.free(request)

    def Step(self, request: Any, context: Any) -> executor_pb2.StepResponse:
        return self.executor.step(request)

    def StepStream(
        self, request_iterator: Iterator[executor_pb2.StepRequest], context: Any
    ) -> Iterator[executor_pb2.StepResponse]:
        """One response per request, in order; step N + 1 is launched while
        the device runs step N (step_pipeline.py). A Reset ends the stream:
        its next message gets FAILED_PRECONDITION."""
        yield from StepPipeline(self.executor, request_iterator, self.executor.session)

    def CopyBlocks(self, request: Any, context: Any) -> executor_pb2.CopyBlocksResponse:
        return self.executor.copy_blocks(request)

    def Reset(self, request: Any, context: Any) -> executor_pb2.ResetResponse:
        return self.executor.reset(request)

    def ListCachedBlocks(
        self, request: Any, context: Any
    ) -> Iterator[executor_pb2.ListCachedBlocksResponse]:
        """The block tags, oldest first, in chunks (snapshotted at the call)."""
        yield from self.executor.list_cached_blocks(request)


class ErrorInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Turns ``ServiceError`` into its status code and message, for unary,
    server-streaming and bidirectional handlers alike."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return inner(request, context)
                except ServiceError as exc:
                    context.abort(exc.code, str(exc))

            return handler._replace(unary_unary=unary)
        if handler.unary_stream is not None:
            inner_responses = handler.unary_stream

            def responses(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from inner_responses(request, context)
                except ServiceError as exc:
                    context.abort(exc.code, str(exc))

            return handler._replace(unary_stream=responses)
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            def stream(requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from inner_stream(requests, context)
                except ServiceError as exc:
                    context.abort(exc.code, str(exc))

            return handler._replace(stream_stream=stream)
        return handler


def build_server(
    executor: Executor, address: str, security: ServerSecurity | None = None
) -> tuple[grpc.Server, int]:
    """A started server for ``executor`` on ``address`` (port 0: any free
    port), with ``security``'s TLS (mutual: only the cluster CA's clients);
    returns it and the bound port. ListenError naming the flag when its port
    or its health port cannot be had."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        interceptors=[RequestDecodingInterceptor(), ErrorInterceptor()],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *GRPC_SERVER_OPTIONS,
        ],
    )
    executor_pb2_grpc.add_ExecutorServicer_to_server(ExecutorServicer(executor), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def not_serving() -> None:
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    executor.on_draining.append(not_serving)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    security = security or ServerSecurity()
    port = bind(server, address, security)
    server.start()
    health_address = security.health_address(address)
    if health_address is not None:
        try:
            start_health_server(health_servicer, health_address, server)
        except ListenError:
            server.stop(grace=0).wait()  # not left serving behind the error
            raise
    return server, port
