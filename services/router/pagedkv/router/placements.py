"""The requests this router placed whose streams are still open.

Load reports lag by up to their publish interval; a burst of requests that
arrives inside one interval would all see the same load and pile onto one
executor. The router therefore adds to each executor's reported load the
placements it made there after the report's time (wall clock milliseconds:
the report's ``updated_ms`` is the scheduler's clock, so clocks are assumed
close, as NTP keeps them). A placement leaves when its stream ends.
"""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple


class Placement(NamedTuple):
    """One open placement (the token ``close`` takes)."""

    key: int
    address: str
    placed_ms: int


class Placements:
    """Open placements by executor address. Only this class's methods change it."""

    def __init__(self) -> None:
        self._open: dict[str, dict[int, int]] = {}  # address -> key -> placed_ms
        self._keys = itertools.count()

    def open(self, address: str) -> Placement:
        placement = Placement(next(self._keys), address, int(time.time() * 1000))
        self._open.setdefault(address, {})[placement.key] = placement.placed_ms
        return placement

    def close(self, placement: Placement) -> None:
        """Idempotent."""
        placed = self._open.get(placement.address)
        if placed is not None:
            placed.pop(placement.key, None)
            if not placed:
                del self._open[placement.address]

    def placed_since(self, address: str, since_ms: int | None) -> int:
        """Open placements on ``address`` made after ``since_ms`` (all with None)."""
        placed = self._open.get(address)
        if not placed:
            return 0
        if since_ms is None:
            return len(placed)
        return sum(1 for placed_ms in placed.values() if placed_ms > since_ms)

    def num_open(self) -> int:
        return sum(len(p) for p in self._open.values())
