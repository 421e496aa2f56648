"""A server's gRPC health while its Redis does not answer: a scheduler that
cannot reach its cluster's Redis claims no executor and no router sees it; a
router that cannot reach it knows no scheduler. Either says it is ready but
serves nothing, so its health is NOT_SERVING (with the reason logged) until
Redis answers again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2

from pagedkv.common.logging import get_logger

LIVENESS = "liveness"
"""A health service name that stays SERVING while the server runs, whatever
Redis says: for liveness probes (the chart's), since restarting a server
that waits for Redis would not bring Redis back."""
POLL_INTERVAL_S = 0.2
REPORT_INTERVAL_S = 10.0  # the reason is logged again this often while it holds

log = get_logger("pagedkv.health")


def initial_status(reason: str | None) -> int:
    """A server's first overall health, before ``follow_redis`` runs:
    NOT_SERVING when its first read of Redis failed (``reason``)."""
    if reason is None:
        return int(health_pb2.HealthCheckResponse.SERVING)
    return int(health_pb2.HealthCheckResponse.NOT_SERVING)


async def follow_redis(
    health_servicer: Any,
    names: tuple[str, ...],
    reason: Callable[[], str | None],
    stopping: Callable[[], bool],
    what: str,
) -> None:
    """Sets ``names``' health on ``health_servicer`` from ``reason()`` (why
    Redis cannot be used, None while it answers): at once whatever it was,
    then NOT_SERVING while there is one, SERVING again once it clears,
    logged as ``what`` (``scheduler``, ``router``). Returns once
    ``stopping()``, leaving NOT_SERVING. A server sets its first status with
    ``initial_status`` (it serves before this runs)."""
    serving_status = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    serving: bool | None = None  # not set here yet
    reported = 0.0
    while not stopping():
        why = reason()
        if (why is None) != serving:
            if why is None and serving is False:
                log.info(f"{what} serving: redis answers")
            serving = why is None
            for name in names:
                await health_servicer.set(name, serving_status if serving else not_serving)
        if why is not None and time.monotonic() - reported >= REPORT_INTERVAL_S:
            reported = time.monotonic()
            log.warning(f"{what} not serving until redis answers", reason=why)
        await asyncio.sleep(POLL_INTERVAL_S)
    for name in names:  # as the stop set it, whatever was set here meanwhile
        await health_servicer.set(name, not_serving)
