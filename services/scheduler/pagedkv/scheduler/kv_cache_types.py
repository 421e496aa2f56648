"""Typed results of the KV cache manager: hits, table updates, copies, stats."""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.common.ids import BlockId
from pagedkv.scheduler.host_tier import HostHit
from pagedkv.scheduler.kv_cache_block import KVCacheBlock


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: per group, the cached blocks; and the tokens they
    hold. ``host``: the blocks after those found in the host tier (one
    full-attention group only), counted in ``num_tokens`` too; each gets a
    fresh GPU block and a load when allocated. ``host_declined``: blocks
    found there that the request recomputes instead (their load costs
    more), not in ``num_tokens``."""

    blocks: tuple[tuple[KVCacheBlock, ...], ...]
    num_tokens: int
    host: tuple[HostHit, ...] = ()
    host_declined: bool = False


class TableUpdate(NamedTuple):
    """One group's block-table change: entries from ``start`` on are ``block_ids``."""

    start: int
    block_ids: tuple[BlockId, ...]


class Allocation(NamedTuple):
    """What ``allocate_slots`` changed: one ``TableUpdate`` per group, or none.

    ``updates`` is empty when no table changed (the common decode step).
    """

    updates: tuple[TableUpdate, ...]


class DecodeAllocation(NamedTuple):
    """What ``allocate_decode_slots`` did.

    ``num_allocated``: requests of the list, from ``start`` on, that got their
    slot (the rest did not, from the first one that could not). ``updates``:
    (index in the list, Allocation) for those whose tables changed.
    """

    num_allocated: int
    updates: list[tuple[int, Allocation]]


class BlockCopy(NamedTuple):
    """A copy-on-write copy of one block for the executor: ``src`` into ``dst``."""

    src: BlockId
    dst: BlockId


class PrefixCacheStats(NamedTuple):
    """Prefix-cache lookups since start: requests looked up, tokens asked,
    tokens hit (in either tier), and of those, tokens hit in the host tier."""

    requests: int
    queries: int
    hits: int
    host_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


NO_TABLE_CHANGE = Allocation(())
