"""The router's Scheduler gRPC service (grpc.aio): clients call it exactly
as they call a scheduler. Generate is forwarded to the scheduler ``route``
chose, with the executor hint; Abort to the scheduler that has the request;
GetStats is summed over the cluster. Health and reflection as on every
service; the health turns NOT_SERVING when the router starts stopping."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.common.ports import GRPC_SERVER_OPTIONS, ListenError
from pagedkv.common.redis_health import LIVENESS, initial_status
from pagedkv.common.request_decoding import AsyncRequestDecodingInterceptor
from pagedkv.common.resume import is_stream_break
from pagedkv.common.server_security import ServerSecurity, bind, start_aio_health_server
from pagedkv.router.schedulers import forwarded_metadata
from pagedkv.router.service import RouterService
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


class RouterServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Forwards calls; the service decides where."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """Streams the chosen scheduler's chunks as they come. A scheduler
        that fails before its first chunk with a broken stream is routed
        around and the next one tried; after a chunk, its status is passed
        on (UNAVAILABLE: the SDK resumes through a router again). Either way
        a scheduler whose stream broke is routed around for a while.
        Cancelling the call cancels the forwarded one."""
        service = self.service
        forward = scheduler_pb2.GenerateRequest()
        forward.CopyFrom(request)
        forward.request_id = request.request_id or uuid.uuid4().hex
        try:
            routes = await service.route(forward)
        except ServiceError as exc:
            await context.abort(exc.code, str(exc))
            return
        metadata = forwarded_metadata(context.invocation_metadata())
        failures = []
        service.num_open_streams += 1
        try:
            for attempt, route in enumerate(routes[: service.config.max_attempts]):
                if attempt and service.metrics is not None:
                    service.metrics.count_retry()
                forward.preferred_executor = route.executor
                placement = service.placements.open(route.executor) if route.executor else None
                service.live[forward.request_id] = route.address
                call = service.channels.stub(route.address).Generate(
                    forward, timeout=context.time_remaining(), metadata=metadata
                )
                sent = False
                try:
                    async for chunk in call:
                        if not sent:
                            service.first_chunk(route, chunk)
                            sent = True
                        yield chunk
                    return
                except grpc.aio.AioRpcError as exc:
                    code, details = exc.code(), exc.details() or ""
                    broke = is_stream_break(code, details)
                    if broke:
                        service.avoid(route.member_id, f"{code.name}: {details}")
                    if sent or not broke:
                        await context.abort(code, details)
                        return
                    failures.append(f"{route.member_id}: {details}")
                finally:
                    call.cancel()
                    if placement is not None:
                        service.placements.close(placement)
                    if service.live.get(forward.request_id) == route.address:
                        del service.live[forward.request_id]
        finally:
            service.num_open_streams -= 1
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "no scheduler could take the request: " + "; ".join(failures),
        )

    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: Any
    ) -> scheduler_pb2.AbortResponse:
        metadata = forwarded_metadata(context.invocation_metadata())
        aborted = await self.service.abort(request.request_id, metadata)
        return scheduler_pb2.AbortResponse(aborted=aborted)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: Any
    ) -> scheduler_pb2.GetStatsResponse:
        metadata = forwarded_metadata(context.invocation_metadata())
        return await self.service.stats(metadata, request)


class RouterServer:
    """The started grpc.aio server and its health servicer."""

    def __init__(self, server: grpc.aio.Server, health_servicer: Any, port: int) -> None:
        self.server = server
        self.health = health_servicer
        self.port = port

    async def not_serving(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def start_server(
    service: RouterService, address: str, security: ServerSecurity | None = None
) -> RouterServer:
    """A started server for ``service`` on ``address`` (port 0: any free
    port), closed as ``security`` says (TLS, tokens); ListenError naming
    the flag when its port or its health port cannot be had."""
    security = security or ServerSecurity()
    server = grpc.aio.server(
        interceptors=[*security.interceptors(), AsyncRequestDecodingInterceptor()],
        options=list(GRPC_SERVER_OPTIONS),
    )
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(RouterServicer(service), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # LIVENESS: whatever Redis says
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    for name in ("", SERVICE_NAME):  # as the service's first read of Redis went
        await health_servicer.set(name, initial_status(service.degraded))
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = bind(server, address, security)
    await server.start()
    health_address = security.health_address(address)
    if health_address is not None:
        try:
            await start_aio_health_server(health_servicer, health_address, server)
        except ListenError:
            await server.stop(grace=0)  # not left serving behind the error
            raise
    return RouterServer(server, health_servicer, port)
