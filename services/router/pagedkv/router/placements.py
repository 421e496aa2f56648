"""The requests this router placed, for correcting lagging load reports.

A scheduler's load report is up to its publish interval old when the router
reads it. Left alone, that lag misleads twice: a burst of requests inside
one interval would all see the same load and pile onto one executor, and a
request that just finished would still count against its executor (so the
next request with the same prefix would be sent elsewhere). The router
therefore corrects each executor's reported load with what it knows
better: plus the placements it made there after the report's time, minus
those it made before that time whose streams have ended since. Times are
wall-clock milliseconds (the report's ``updated_ms`` is the scheduler's
clock, so clocks are assumed close, as NTP keeps them).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import NamedTuple

CLOSED_HISTORY_MS = 2_000
"""How long ended placements are remembered: longer than any report's age
(reports are rewritten at least every second)."""


class Placement(NamedTuple):
    """One open placement (the token ``close`` takes)."""

    key: int
    address: str
    placed_ms: int


class _Closed(NamedTuple):
    placed_ms: int
    closed_ms: int


class Placements:
    """Open and recently ended placements by executor address. Only this
    class's methods change it."""

    def __init__(self) -> None:
        self._open: dict[str, dict[int, int]] = {}  # address -> key -> placed_ms
        self._closed: dict[str, deque[_Closed]] = {}  # address -> in closing order
        self._keys = itertools.count()

    def open(self, address: str) -> Placement:
        placement = Placement(next(self._keys), address, now_ms())
        self._open.setdefault(address, {})[placement.key] = placement.placed_ms
        return placement

    def close(self, placement: Placement) -> None:
        """Idempotent."""
        placed = self._open.get(placement.address)
        if placed is None or placed.pop(placement.key, None) is None:
            return
        if not placed:
            del self._open[placement.address]
        now = now_ms()
        closed = self._closed.setdefault(placement.address, deque())
        closed.append(_Closed(placement.placed_ms, now))
        while now - closed[0].closed_ms > CLOSED_HISTORY_MS:
            closed.popleft()

    def correction(self, address: str, report_ms: int | None) -> int:
        """What to add to ``address``'s load as reported at ``report_ms``:
        open placements made after it, minus placements made before it that
        ended after it. Without a report (None): every open placement."""
        placed = self._open.get(address, {})
        if report_ms is None:
            return len(placed)
        added = sum(1 for placed_ms in placed.values() if placed_ms > report_ms)
        ended = sum(
            1 for c in self._closed.get(address, ()) if c.placed_ms <= report_ms < c.closed_ms
        )
        return added - ended

    def num_open(self) -> int:
        return sum(len(p) for p in self._open.values())


def now_ms() -> int:
    """Wall-clock milliseconds."""
    return int(time.time() * 1000)
