"""The pool of KV blocks: ref counts, the free queue and the prefix-cache index.

Ownership: the pool owns every ``KVCacheBlock``. Holders (block tables in the
``KVCacheManager``) take a reference with ``get_new_blocks`` or ``touch`` and
give it back with ``free_blocks``; a block whose ref count drops to 0 goes to
the tail of the free queue (kv_cache_block.py: the block record and the
queue's links).

Eviction order: ``get_new_blocks`` pops from the head of the free queue, so
blocks freed earlier are reused first, and within one ``free_blocks`` call the
caller's order is kept (the manager passes a request's tail block first, so a
shared prefix's head blocks survive longest). A block that is still in the
prefix-cache index stays there while it sits in the free queue, so a later
request can take it back with ``touch``; its hash is dropped only when the
block is popped for reuse (lazy eviction).

Host tier: with a ``HostTier`` in ``host``, the blocks entered into the
index are listed in ``fresh`` (the manager writes them through to the host
once their step has been sent), and a cached block evicted for reuse whose
hash the host lacks is offloaded then (host_tier.py; ``_evict_all``),
unless it entered the index in the step not yet sent (``step`` counts the
steps sent: the manager advances it as it drains a step's copies).

Cache events: with ``record_events``, every change to the index is logged in
order as a ``CacheEvent`` (a block stored under a hash, or removed from the
index) until ``take_events`` drains the log. The scheduler turns the log into
the executor's block tags and the Redis prefix mirror, so both follow the
index exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pagedkv.common.ids import NULL_BLOCK_ID, BlockHash, BlockId
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind
from pagedkv.scheduler.host_tier import HostTier
from pagedkv.scheduler.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock

# The index's events are built by the tuple's own constructor (the same
# CacheEvents, without the generated ``__new__``'s call): a step that loads a
# host hit logs one per block twice over (its evictions, its loaded blocks).
_new = tuple.__new__
_STORED, _REMOVED = CacheEventKind.STORED, CacheEventKind.REMOVED


class IntegrityReport(NamedTuple):
    """What ``check_integrity`` found. ``ok`` when ``errors`` is empty."""

    num_blocks: int
    num_free: int
    num_used: int
    num_cached: int
    errors: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.errors


class BlockPool:
    """All ``num_blocks`` blocks of one executor's KV cache.

    Block 0 is the null block: never in the free queue, never handed out, its
    ref count is not tracked. ``num_groups`` KV-cache groups share the blocks;
    each group has its own prefix-cache index (hash → block).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        num_groups: int = 1,
        *,
        record_events: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # The fewest free blocks since the last ``reset_peak``: checked once
        # per call that takes blocks, not per block.
        self.min_free_blocks = num_blocks - 1
        self.cached_blocks: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self.events: list[CacheEvent] | None = [] if record_events else None
        self.host: HostTier | None = None
        self.step = 0
        # With a host tier: the blocks entered into the index since the last
        # step was sent (the manager writes them through to the host).
        self.fresh: list[KVCacheBlock] = []

    # -- allocation -----------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out now (cached ones included)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    @property
    def peak_used_blocks(self) -> int:
        """The most usable blocks held at once since the last ``reset_peak``
        (or since the pool was made)."""
        return self.num_blocks - 1 - self.min_free_blocks

    def reset_peak(self) -> None:
        """Starts ``peak_used_blocks`` over from the blocks held now."""
        self.min_free_blocks = self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops ``num_blocks`` from the head of the free queue with ref_cnt 1.

        A popped block that was in the prefix-cache index is evicted from it.
        Raises ValueError when fewer blocks are free; callers check first.
        """
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: {queue.num_free_blocks} are free")
        blocks = queue.popleft_n(num_blocks)
        if queue.num_free_blocks < self.min_free_blocks:
            self.min_free_blocks = queue.num_free_blocks
        cached = []
        for block in blocks:
            block.ref_cnt = 1
            if block.block_hash is not None:
                cached.append(block)
        if cached:
            self._evict_all(cached)
        return blocks

    def get_new_block(self) -> KVCacheBlock:
        """``get_new_blocks(1)`` without the list: the head of the free queue."""
        queue = self.free_block_queue
        if not queue.num_free_blocks:
            raise ValueError("cannot get a block: none is free")
        block = queue.popleft()
        if queue.num_free_blocks < self.min_free_blocks:
            self.min_free_blocks = queue.num_free_blocks
        if block.block_hash is not None:
            self._evict_all((block,))
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on each block (a prefix-cache hit or a fork).

        A block with ref_cnt 0 leaves the free queue, so it cannot be evicted
        while held. Null blocks are skipped.
        """
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1
        if queue.num_free_blocks < self.min_free_blocks:
            self.min_free_blocks = queue.num_free_blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference on each block, in eviction order.

        Blocks reaching ref_cnt 0 are appended to the free queue in the given
        order (first given = evicted first). Null blocks are skipped. Cached
        blocks keep their hash until they are popped for reuse.
        """
        released = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if not block.ref_cnt:
                released.append(block)
        self.free_block_queue.append_n(released)

    # -- prefix cache ----------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """The block holding ``block_hash`` in ``group_id``'s index, if any."""
        return self.cached_blocks[group_id].get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Enters ``blocks[num_cached_blocks:num_full_blocks]`` into the index.

        ``block_hashes[i]`` is the hash of ``blocks[i]``. Null placeholders and
        blocks already cached are skipped. When another block already holds
        the same hash (two requests computed the same prefix at once), the new
        block stays out of the index and is reused as a plain block once freed.
        """
        if not self.enable_caching:
            return
        setdefault, step = self.cached_blocks[group_id].setdefault, self.step
        fresh = self.fresh if self.host is not None else None
        events = self.events
        for block, block_hash in zip(
            blocks[num_cached_blocks:num_full_blocks],
            block_hashes[num_cached_blocks:num_full_blocks],
            strict=True,
        ):
            if (
                block.block_hash is None
                and not block.is_null
                and setdefault(block_hash, block) is block
            ):
                block.block_hash = block_hash
                block.group_id = group_id
                block.cached_step = step
                if fresh is not None:
                    fresh.append(block)
                if events is not None:
                    events.append(_new(CacheEvent, (_STORED, block.block_id, block_hash, group_id)))

    def _evict_all(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drops each cached block's hash from its index, in order; with a host
        tier the ones not entered in the step not yet sent are offloaded, in
        one call (``HostTier.offload_all``)."""
        indexes, step, events, host = self.cached_blocks, self.step, self.events, self.host
        offloads: list[tuple[BlockId, BlockHash]] = []
        for block in blocks:
            block_hash = block.block_hash
            assert block_hash is not None
            group_id = block.group_id
            del indexes[group_id][block_hash]
            block.block_hash = None
            if host is not None and block.cached_step != step:
                offloads.append((block.block_id, block_hash))
            if events is not None:
                events.append(_new(CacheEvent, (_REMOVED, block.block_id, block_hash, group_id)))
        if offloads:
            assert host is not None
            host.offload_all(offloads)

    def take_events(self) -> list[CacheEvent]:
        """Drains the cache events logged since the last call, in order
        (always empty without ``record_events``)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def adopt_cached_blocks(self, cached: Iterable[CacheEvent]) -> int:
        """Enters blocks whose KV is already on the executor into the index
        of a pool that holds nothing yet (an executor taken over with its
        cache) and returns how many it adopted. ``cached`` is in eviction
        order, oldest first: adopted blocks move to the tail of the free
        queue in that order, behind every block that holds nothing. An entry
        it cannot adopt (a block or hash already indexed, caching off) is
        logged as REMOVED when events are recorded, so its tag is dropped;
        ids or groups out of range are skipped."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            raise ValueError("adopt_cached_blocks: the pool must hold no block")
        queue = self.free_block_queue
        num_adopted = 0
        for entry in cached:
            block_id, block_hash, group_id = entry.block_id, entry.block_hash, entry.group_id
            if not 0 < block_id < self.num_blocks or not 0 <= group_id < len(self.cached_blocks):
                continue
            block = self.blocks[block_id]
            index = self.cached_blocks[group_id]
            if not self.enable_caching or block.block_hash is not None or block_hash in index:
                if self.events is not None:
                    self.events.append(entry._replace(kind=CacheEventKind.REMOVED))
                continue
            index[block_hash] = block
            block.block_hash = block_hash
            block.group_id = group_id
            block.cached_step = self.step - 1  # computed before any step of this pool
            queue.remove(block)
            queue.append(block)
            num_adopted += 1
        return num_adopted

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix-cache index. Refused (False) while any block is held."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for group_id, index in enumerate(self.cached_blocks):
            for block_hash, block in index.items():
                block.block_hash = None
                if self.events is not None:
                    self.events.append(
                        CacheEvent(CacheEventKind.REMOVED, block.block_id, block_hash, group_id)
                    )
            index.clear()
        return True

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(index) for index in self.cached_blocks)

    # -- checks ----------------------------------------------------------------------

    def check_integrity(self) -> IntegrityReport:
        """Walks every structure and reports broken invariants (O(num_blocks)).

        Checked: the free queue's links and count; free blocks have ref_cnt 0
        and every block with ref_cnt 0 is free; the null block is never free;
        free + used == usable; every index entry points at a block carrying
        that hash and group, and every block carrying a hash is indexed.
        Holder counts are checked by the ``KVCacheManager``, which knows them.
        """
        seen, errors = self.free_block_queue.check_links()
        num_free = len(seen)
        if NULL_BLOCK_ID in seen:
            errors.append("the null block is in the free queue")
        num_used = 0
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                errors.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}")
            free = block.block_id in seen
            if free and block.ref_cnt:
                errors.append(f"block {block.block_id}: free with ref_cnt {block.ref_cnt}")
            if not free and not block.ref_cnt:
                errors.append(f"block {block.block_id}: ref_cnt 0 but not free (leaked)")
            if block.ref_cnt:
                num_used += 1
            if block.block_hash is not None:
                group_id = block.group_id
                groups = self.cached_blocks
                index = groups[group_id] if 0 <= group_id < len(groups) else {}
                if index.get(block.block_hash) is not block:
                    errors.append(f"block {block.block_id}: carries a hash the index lacks")
        if num_free + num_used != self.num_blocks - 1:
            errors.append(f"free {num_free} + used {num_used} != usable {self.num_blocks - 1}")
        for group_id, index in enumerate(self.cached_blocks):
            for block_hash, block in index.items():
                if block.block_hash != block_hash or block.group_id != group_id:
                    errors.append(
                        f"index entry {block_hash.hex()[:8]}: block {block.block_id} differs"
                    )
                if block.is_null:
                    errors.append("the null block is in the prefix-cache index")
        return IntegrityReport(
            num_blocks=self.num_blocks,
            num_free=num_free,
            num_used=num_used,
            num_cached=self.num_cached_blocks,
            errors=tuple(errors),
        )
