"""The router's own placements correct a lagging load report both ways."""

from __future__ import annotations

import time

from pagedkv.router.placements import Placements


def now_ms() -> int:
    return int(time.time() * 1000)


def test_a_report_is_corrected_by_placements_made_and_ended_since() -> None:
    placements = Placements()
    before = placements.open("a:1")
    ended = placements.open("a:1")
    time.sleep(0.01)
    report_ms = now_ms()  # the report counts both as running
    time.sleep(0.01)
    placements.close(ended)  # ended after the report: one too many there
    after = placements.open("a:1")  # made after the report: one missing there
    placements.open("a:1")
    assert placements.correction("a:1", report_ms) == 2 - 1
    assert placements.correction("a:1", None) == 3  # no report: what is open
    assert placements.correction("b:1", report_ms) == 0
    placements.close(after)
    placements.close(after)  # idempotent
    assert placements.correction("a:1", report_ms) == 1 - 1
    later_ms = now_ms() + 1  # a report taken after everything: nothing to correct
    assert placements.correction("a:1", later_ms) == 0
    placements.close(before)
    assert placements.num_open() == 1
