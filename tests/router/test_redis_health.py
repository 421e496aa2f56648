"""Health that follows Redis from the first answer on: a server whose first
read of Redis failed starts NOT_SERVING (its "liveness" SERVING), and
``follow_redis`` sets the status its first look finds, whatever the server
started with."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.common.redis_health import LIVENESS, follow_redis
from pagedkv.router.service import RouterConfig, RouterService
from pagedkv.router.servicer import start_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RecordedHealth:
    """A health servicer's ``set`` calls, in order."""

    def __init__(self) -> None:
        self.sets: list[tuple[str, int]] = []

    async def set(self, name: str, status: int) -> None:
        self.sets.append((name, status))


def test_follow_redis_sets_serving_at_once_when_redis_answers() -> None:
    health = RecordedHealth()
    looks = iter([False, True])  # stop after the first look

    asyncio.run(follow_redis(health, ("", "svc"), lambda: None, lambda: next(looks), "router"))
    assert health.sets == [("", SERVING), ("svc", SERVING), ("", NOT_SERVING), ("svc", NOT_SERVING)]


def test_follow_redis_sets_not_serving_at_once_while_redis_does_not_answer() -> None:
    health = RecordedHealth()
    looks = iter([False, True])

    asyncio.run(follow_redis(health, ("",), lambda: "redis down", lambda: next(looks), "router"))
    assert health.sets == [("", NOT_SERVING), ("", NOT_SERVING)]


def test_a_router_whose_first_redis_read_failed_starts_not_serving() -> None:
    async def main() -> tuple[int, int]:
        service = RouterService(RouterConfig(redis_url="redis://127.0.0.1:1/0"))
        assert service.degraded is not None  # nothing read yet
        server = await start_server(service, "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                overall = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                alive = await stub.Check(
                    health_pb2.HealthCheckRequest(service=LIVENESS), timeout=10
                )
            return overall.status, alive.status
        finally:
            await server.server.stop(grace=0)
            await service.redis.aclose()

    assert asyncio.run(main()) == (NOT_SERVING, SERVING)
