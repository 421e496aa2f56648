"""Changes to a block pool's prefix-cache index, and what they mean for the
executor's block tags.

The pool logs a ``CacheEvent`` for every block that enters its index under a
hash (STORED) or leaves it (REMOVED: evicted for reuse, or the index reset).
Two consumers follow the index through that one log: the executor's block
tags (``tag_changes``, sent in the step messages) and the Redis prefix mirror.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

from pagedkv.common.ids import BlockHash, BlockId


class CacheEventKind(IntEnum):
    STORED = 1  # the block entered the index under the hash
    REMOVED = 2  # the block left the index


class CacheEvent(NamedTuple):
    """One change to the prefix-cache index."""

    kind: CacheEventKind
    block_id: BlockId
    block_hash: BlockHash
    group_id: int


class TagChanges(NamedTuple):
    """The executor's tag columns for a batch of events: ``untag`` (applied
    before the message's writes) and ``tags`` (applied after its forward)."""

    untag: list[int]
    tags: list[CacheEvent]


def tag_changes(events: list[CacheEvent]) -> TagChanges:
    """Every block removed from the index in ``events`` is untagged, and every
    block whose last event is STORED is tagged with that hash. So a block
    stored and evicted in one batch ends untagged, and one evicted and stored
    again ends with its new tag, never its old one (the untag is applied
    before any write into it)."""
    untag: dict[int, None] = {}
    last: dict[int, CacheEvent] = {}
    for event in events:
        if event.kind is CacheEventKind.REMOVED:
            untag[event.block_id] = None
        last[event.block_id] = event
    tags = [event for event in last.values() if event.kind is CacheEventKind.STORED]
    return TagChanges(list(untag), tags)
