"""The integrity audits that GetStats reports (``Audits``).

An audit (``KVCacheManager.check_integrity``) walks every block of an
executor's pool, its holders and its host tier, on the event loop that
serves every stream and step of the process, and a small model's pool on
a large GPU holds hundreds of thousands of blocks: a caller polling
GetStats would stall serving for that walk each time. An executor with
requests is therefore audited at most once per interval; one with none,
for every call (nobody waits on it then).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedkv.scheduler.block_pool import IntegrityReport

if TYPE_CHECKING:
    from pagedkv.scheduler.executor_scheduler import ExecutorScheduler

AUDIT_INTERVAL_S = 10.0


class Audits:
    """Each executor scheduler's latest integrity audit (when it ran, by
    ``clock``, and its report), held weakly: a recovered executor's new
    scheduler has none, and a scheduler gone from the registry takes its
    audit with it."""

    def __init__(
        self, interval_s: float = AUDIT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._latest: weakref.WeakKeyDictionary[
            ExecutorScheduler, tuple[float, IntegrityReport]
        ] = weakref.WeakKeyDictionary()

    def report(self, scheduler: ExecutorScheduler) -> IntegrityReport:
        """``scheduler``'s integrity report: audited now when it has no
        request running or waiting, when it has no audit yet, or when its
        latest is ``interval_s`` old or more; else the latest one's report."""
        now = self._clock()
        latest = self._latest.get(scheduler)
        busy = bool(scheduler.running or scheduler.waiting)
        if latest is None or not busy or now - latest[0] >= self.interval_s:
            latest = (now, scheduler.kv.check_integrity())
            self._latest[scheduler] = latest
        return latest[1]
