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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.scheduler.block_pool import IntegrityReport

if TYPE_CHECKING:
    from pagedkv.scheduler.executor_scheduler import ExecutorScheduler

AUDIT_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class _Audit:
    scheduler: ExecutorScheduler  # whose pool: a recovered executor has a new one
    at: float  # the clock's reading when it ran
    report: IntegrityReport


class Audits:
    """Each executor's latest integrity audit, by address."""

    def __init__(
        self, interval_s: float = AUDIT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._latest: dict[str, _Audit] = {}

    def report(self, address: str, scheduler: ExecutorScheduler) -> IntegrityReport:
        """``scheduler``'s integrity report: audited now when it has no
        request running or waiting, when its latest audit is ``interval_s``
        old or more, or when there is none of this scheduler (its executor
        recovered); else the latest audit's report. Records a new audit."""
        now = self._clock()
        latest = self._latest.get(address)
        busy = bool(scheduler.running or scheduler.waiting)
        if (
            latest is None
            or latest.scheduler is not scheduler
            or not busy
            or now - latest.at >= self.interval_s
        ):
            latest = _Audit(scheduler, now, scheduler.kv.check_integrity())
            self._latest[address] = latest
        return latest.report

    def keep(self, addresses: Iterable[str]) -> None:
        """Forgets the audits of executors not among ``addresses`` (each
        holds its scheduler, and so its pool, alive)."""
        kept = set(addresses)
        for address in [a for a in self._latest if a not in kept]:
            del self._latest[address]
