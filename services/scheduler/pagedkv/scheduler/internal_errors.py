"""Errors in the scheduler's own code: each is logged with an id, counted
(``GetStats.num_internal_errors`` and the metrics), and becomes the INTERNAL
error the requests it concerns end with. The service, the executors'
registry, the generations and the step loops report to one
``InternalErrors``."""

from __future__ import annotations

import uuid
from typing import Any

from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.metrics import SchedulerMetrics

log = get_logger(__name__)


class InternalErrors:
    """The count of the scheduler's own errors; only ``report`` changes it."""

    def __init__(self, metrics: SchedulerMetrics | None) -> None:
        self.metrics = metrics
        self.count = 0

    def report(self, exc: BaseException, where: str, **context: Any) -> ServiceError:
        """Logs and counts ``exc``; returns the INTERNAL error its requests
        end with (an id ties it to the log)."""
        error_id = uuid.uuid4().hex[:12]
        self.count += 1
        if self.metrics is not None:
            self.metrics.count_internal_error()
        log.error("internal error", where=where, error_id=error_id, exc_info=exc, **context)
        return ServiceError(f"internal error in the scheduler (error id {error_id})")
