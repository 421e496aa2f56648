"""The event-loop lag: a callback that holds the loop shows as a lag as long
as it held it, in the scheduler's and the router's metrics."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from pagedkv.common.loop_lag import LoopLag
from pagedkv.router.metrics import RouterMetrics
from pagedkv.scheduler.metrics import SchedulerMetrics

INTERVAL = 0.02
BLOCK = 0.3


def lags_around_a_block() -> list[float]:
    """The lags measured while the loop idles, is held ``BLOCK`` seconds by
    one callback, and idles again."""
    lags: list[float] = []

    async def main() -> None:
        lag = LoopLag(lags.append, INTERVAL)
        lag.start()
        await asyncio.sleep(3 * INTERVAL)
        time.sleep(BLOCK)  # a long callback on the loop
        await asyncio.sleep(3 * INTERVAL)
        await lag.stop()

    asyncio.run(main())
    return lags


def test_a_callback_holding_the_loop_is_measured_as_that_long_a_lag() -> None:
    lags = lags_around_a_block()
    assert len(lags) >= 3
    assert all(lag >= 0 for lag in lags)
    # The task was due at most INTERVAL after the block began.
    assert max(lags) >= BLOCK - INTERVAL


def sum_of(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name + "_sum")
    assert value is not None, name
    return value


def test_the_scheduler_and_the_router_expose_the_lag() -> None:
    scheduler, router = SchedulerMetrics(), RouterMetrics()
    for seconds in lags_around_a_block():
        scheduler.observe_loop_lag(seconds)
        router.observe_loop_lag(seconds)
    assert sum_of(scheduler.registry, "pagedkv_event_loop_lag_seconds") >= BLOCK - INTERVAL
    assert sum_of(router.registry, "pagedkv_router_event_loop_lag_seconds") >= BLOCK - INTERVAL
