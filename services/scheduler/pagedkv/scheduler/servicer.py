"""The Scheduler gRPC service (grpc.aio): ``SchedulerServicer`` and the
server around it, with gRPC health and reflection (an undecodable request is
INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedkv.common.errors import ServiceError
from pagedkv.common.ports import GRPC_SERVER_OPTIONS
from pagedkv.common.redis_health import LIVENESS, follow_redis, initial_status
from pagedkv.common.request_decoding import AsyncRequestDecodingInterceptor
from pagedkv.common.server_security import ServerSecurity, aio_health_server, bind, serve_aio_health
from pagedkv.scheduler.service import SchedulerService
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
MAX_STREAM_PACE = 0.05
"""The longest pause between a stream's messages, seconds (see chunks.py)."""


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Thin: calls go to ``SchedulerService``; its errors become statuses here."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """Streams a generation's chunks. Cancelling the call (client gone,
        deadline passed) aborts the generation and frees its blocks."""
        try:
            text_ids = await self.service.encode_text(request)
            generation = self.service.submit(request, text_ids)
        except ServiceError as exc:
            await context.abort(exc.code, str(exc))
            return
        try:
            while True:
                item = await generation.chunks.get()
                if isinstance(item, ServiceError):
                    await context.abort(item.code, str(item))
                    return
                assert isinstance(item, scheduler_pb2.GenerateResponse)
                yield item
                if not item.HasField("usage"):
                    await generation.chunks.pause(self._stream_pace())
                    continue
                # A failure's final chunk (FINISH_REASON_ERROR) is followed
                # by its status.
                if not generation.chunks.empty():
                    error = generation.chunks.get_nowait()
                    if isinstance(error, ServiceError):
                        await context.abort(error.code, str(error))
                return
        finally:
            if not generation.done:
                self.service.abort(generation.request_id)

    def _stream_pace(self) -> float:
        """Seconds a stream waits after a message (see chunks.py): more
        open streams, fewer and larger messages each."""
        service = self.service
        pace = service.config.stream_pace_per_stream * len(service.generations)
        return min(pace, MAX_STREAM_PACE)

    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: Any
    ) -> scheduler_pb2.AbortResponse:
        return scheduler_pb2.AbortResponse(aborted=self.service.abort(request.request_id))

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: Any
    ) -> scheduler_pb2.GetStatsResponse:
        return self.service.stats(request.reset_peak_used_blocks)


class BoundServer(NamedTuple):
    """A scheduler's servers with their ports bound, not serving yet
    (``bind_server``; ``start_server`` serves them)."""

    server: grpc.aio.Server
    port: int  # bound (the one chosen for port 0)
    health: Any  # the health servicer, shared by the main and the health port
    health_server: grpc.aio.Server | None  # on --health-port


def bind_server(address: str, security: ServerSecurity | None = None) -> BoundServer:
    """A grpc.aio server holding ``address``'s port (port 0: any free port)
    and the health port's, closed as ``security`` says (TLS, tokens); no
    call is served until ``start_server``. ListenError naming the flag when a
    port cannot be had. Binding first lets the scheduler refuse a port in
    use before it takes anything over, and register the port it holds."""
    security = security or ServerSecurity()
    server = grpc.aio.server(
        interceptors=[*security.interceptors(), AsyncRequestDecodingInterceptor()],
        options=list(GRPC_SERVER_OPTIONS),
    )
    port = bind(server, address, security)
    health_servicer = health.aio.HealthServicer()
    health_address = security.health_address(address)
    health_server = None
    if health_address is not None:
        health_server = aio_health_server(health_servicer, health_address)
    return BoundServer(server, port, health_servicer, health_server)


async def start_server(bound: BoundServer, service: SchedulerService) -> None:
    """Serves ``service`` on the ``bound`` server (and health on its health
    port). Its health is SERVING until the service starts draining,
    NOT_SERVING from then on; in a cluster, NOT_SERVING too while its Redis
    does not answer (``pagedkv.common.redis_health``)."""
    server, health_servicer = bound.server, bound.health
    servicer = SchedulerServicer(service)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    cluster = service.executors.cluster
    degraded = cluster.degraded if cluster is not None else None
    for name in ("", SERVICE_NAME):  # as the member's first round went
        await health_servicer.set(name, initial_status(degraded))

    async def not_serving() -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    if cluster is not None:  # NOT_SERVING while its Redis does not answer
        follower = asyncio.create_task(
            follow_redis(
                health_servicer,
                ("", SERVICE_NAME),
                lambda: cluster.degraded,
                lambda: service.draining,
                "scheduler",
            )
        )

        async def stop_following() -> None:
            follower.cancel()

        service.on_draining.append(stop_following)
    service.on_draining.append(not_serving)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    await server.start()
    if bound.health_server is not None:
        await serve_aio_health(bound.health_server, server)
