"""Readiness that reflects Redis: a router whose Redis does not answer, and a
scheduler whose Redis refuses its password, report NOT_SERVING health and
log why until Redis answers, then SERVING; their "liveness" health stays
SERVING throughout (the chart's liveness probe asks it)."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.common.redis_health import LIVENESS
from tests.cluster.cluster_stack import SchedulerProcess, wait_until
from tests.processes import ServedProcess
from tests.redis_server import RedisServer
from tests.router.router_stack import RouterProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(process: ServedProcess, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(process.channel)
    try:
        status: int = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
    except grpc.RpcError:
        return -1
    return status


def test_a_router_is_not_serving_while_its_redis_does_not_answer() -> None:
    with RedisServer() as server:
        server.kill()
        with RouterProcess(server.url) as router:
            wait_until(lambda: _health(router) == NOT_SERVING, what="router NOT_SERVING")
            wait_until(
                lambda: "router not serving until redis answers" in router.stderr(),
                what="the reason logged",
            )
            assert f"127.0.0.1:{server.port}" in router.stderr()
            assert _health(router, LIVENESS) == SERVING  # nothing a restart would mend
            server.start()
            wait_until(lambda: _health(router) == SERVING, what="router SERVING once redis answers")
            assert "router serving: redis answers" in router.stderr()


def test_a_scheduler_refused_by_redis_is_not_serving_until_redis_takes_its_password(
    tmp_path: Path,
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("not-the-password\n")
    with (
        RedisServer(password="the-password") as server,
        SchedulerProcess(server.url, "--redis-password-file", str(password_file)) as scheduler,
    ):
        wait_until(lambda: _health(scheduler) == NOT_SERVING, what="scheduler NOT_SERVING")
        wait_until(
            lambda: "scheduler not serving until redis answers" in scheduler.stderr(),
            what="the reason logged",
        )
        assert "not-the-password" not in scheduler.stderr()
        assert _health(scheduler, LIVENESS) == SERVING
        server.client().config_set("requirepass", "not-the-password")
        wait_until(
            lambda: _health(scheduler) == SERVING, what="scheduler SERVING once redis answers"
        )
