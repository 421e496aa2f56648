"""GetStats' integrity audits (``Audits``): fresh for an executor with no
request, at most once an interval for a busy one, and fresh again for a
recovered executor's new scheduler; none holds a scheduler alive."""

from __future__ import annotations

import gc

from pagedkv.scheduler.audits import Audits
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from tests.scheduler.stepping import add_generation, live_scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def break_a_block(scheduler: ExecutorScheduler) -> None:
    scheduler.kv.pool.blocks[3].ref_cnt = -1


def test_an_idle_executor_is_audited_for_every_call() -> None:
    clock = Clock()
    audits = Audits(interval_s=10.0, clock=clock)
    scheduler = live_scheduler(num_blocks=32)
    assert audits.report(scheduler).ok
    break_a_block(scheduler)
    report = audits.report(scheduler)
    assert "block 3: ref_cnt -1" in report.errors


def test_a_busy_executor_is_audited_once_an_interval() -> None:
    clock = Clock()
    audits = Audits(interval_s=10.0, clock=clock)
    scheduler = live_scheduler(num_blocks=32)
    add_generation(scheduler, "r", list(range(20)), 4, key=1)  # waiting: busy
    first = audits.report(scheduler)
    assert first.ok
    break_a_block(scheduler)
    clock.now += 9.9
    assert audits.report(scheduler) is first  # the latest audit's report
    clock.now += 0.1
    assert not audits.report(scheduler).ok
    # Another executor's audits are its own.
    other = live_scheduler(num_blocks=32)
    assert audits.report(other).ok


def test_a_recovered_executor_is_audited_at_once() -> None:
    clock = Clock()
    audits = Audits(interval_s=10.0, clock=clock)
    scheduler = live_scheduler(num_blocks=32)
    add_generation(scheduler, "r", list(range(20)), 4, key=1)
    assert audits.report(scheduler).ok
    recovered = live_scheduler(num_blocks=32)
    add_generation(recovered, "r", list(range(20)), 4, key=1)
    break_a_block(recovered)
    assert not audits.report(recovered).ok


def test_a_scheduler_gone_takes_its_audit_with_it() -> None:
    audits = Audits(interval_s=10.0, clock=Clock())
    scheduler = live_scheduler(num_blocks=32)
    add_generation(scheduler, "r", list(range(20)), 4, key=1)
    audits.report(scheduler)
    assert len(audits._latest) == 1
    del scheduler
    gc.collect()
    assert len(audits._latest) == 0  # its pool is not held alive
