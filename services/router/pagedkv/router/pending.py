"""Prompts this router just placed, as cache entries to expect.

A scheduler stores a prompt's blocks in its prefix cache when it schedules
the prompt, and the router learns of them only when the KV events arrive
(a mirror flush plus the follower's read later). Requests that share a
prefix and arrive inside that window would each find the prefix cached
nowhere and be spread over the cluster, each copy computing the prefix
again: a burst of sessions opening on one system prompt is the common case.
So for ``ttl_ms`` after a placement the router counts the placed prompt's
blocks as held by the chosen executor, next to the index. An entry that
never comes true (the request failed before it was scheduled) costs one
misplaced request at most, and it expires.

Times are passed in (milliseconds), so the cluster simulation drives the
same code on its own clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from pagedkv.router.index import PrefixIndex

PENDING_TTL_MS = 2_000
"""Longer than a placed prompt takes to show in the index: a mirror flush
(every 50 ms) and the follower's next read, plus scheduling under load."""


class _Entry(NamedTuple):
    expires_ms: int
    holder: str
    hashes: tuple[bytes, ...]


class PendingPrompts:
    """Block hashes expected in holders' caches, each for ``ttl_ms``. Only
    this class's methods change it; ``match`` answers like ``PrefixIndex.match``."""

    def __init__(self, ttl_ms: int = PENDING_TTL_MS) -> None:
        self.ttl_ms = ttl_ms
        self._index = PrefixIndex()
        self._counts: dict[tuple[str, bytes], int] = {}  # entries naming each pair
        self._entries: deque[_Entry] = deque()  # in expiry order

    def add(self, holder: str, hashes: Sequence[bytes], now_ms: int) -> None:
        """``holder`` was just chosen for a prompt of these block hashes."""
        if not hashes:
            return
        self.expire(now_ms)
        entry = _Entry(now_ms + self.ttl_ms, holder, tuple(hashes))
        self._entries.append(entry)
        counts = self._counts
        for block_hash in entry.hashes:
            key = (holder, block_hash)
            counts[key] = counts.get(key, 0) + 1
        self._index.add(holder, entry.hashes)

    def expire(self, now_ms: int) -> None:
        """Drops the entries whose time is up."""
        entries, counts = self._entries, self._counts
        while entries and entries[0].expires_ms <= now_ms:
            entry = entries.popleft()
            gone = []
            for block_hash in entry.hashes:
                key = (entry.holder, block_hash)
                left = counts[key] - 1
                if left:
                    counts[key] = left
                else:
                    del counts[key]
                    gone.append(block_hash)
            self._index.remove(entry.holder, gone)
            if not self._index.num_blocks(entry.holder):
                self._index.clear(entry.holder)

    def match(self, hashes: Sequence[bytes], now_ms: int) -> dict[str, int]:
        """For each holder expected to hold ``hashes[0]``: how many leading
        blocks of ``hashes`` it is expected to hold."""
        self.expire(now_ms)
        return self._index.match(hashes)

    def __len__(self) -> int:
        return len(self._entries)


def merged(held: dict[str, int], expected: dict[str, int]) -> dict[str, int]:
    """Leading blocks per holder: the longer of what the index holds and
    what pending placements lead to expect."""
    out = dict(held)
    for holder, depth in expected.items():
        if depth > out.get(holder, 0):
            out[holder] = depth
    return out
