"""What taking an executor over yields (``ExecutorFailover.take_over``),
handed between the failover paths, the service and the cluster member."""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.scheduler.cache_events import CacheEvent
from pagedkv.v1 import executor_pb2


class TakenOver(NamedTuple):
    """An executor just taken over: its GetInfo and its tagged blocks."""

    info: executor_pb2.GetInfoResponse
    cached: list[CacheEvent]
