"""Block tables of one KV-cache group: full attention or sliding window.

A manager owns, per request, the list of blocks of its group (the block
table: logical block i → physical block) and how many of them are in the
prefix-cache index. Blocks come from, and go back to, the shared
``BlockPool``. The ``KVCacheManager`` drives the managers of all groups so
that an allocation either happens in every group or in none.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.common.ids import BlockHash, BlockId, SeqId
from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.scheduler.block_pool import BlockPool
from pagedkv.scheduler.kv_cache_block import KVCacheBlock


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Full-attention block tables; ``SlidingWindowManager`` refines it.

    Copy-on-write: a block in the write range of an allocation (the block that
    will receive the next token) that is shared (ref_cnt > 1, after a fork) is
    replaced by a fresh block, and a copy ``(old, new)`` is recorded in
    ``copy_ops`` for the executor to run before the step's forward.
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.null_block = pool.null_block
        self.req_to_blocks: dict[SeqId, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[SeqId, int] = {}

    # -- planning (no state change) ---------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        seq_id: SeqId,
        num_computed_tokens: int,
        num_slots: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        """Fresh blocks needed so that ``num_slots`` tokens have a slot.

        Counts new blocks past the table's end plus a copy-on-write
        replacement when the block receiving token ``num_computed_tokens`` is
        shared.
        """
        blocks = self.req_to_blocks.get(seq_id, ())
        num_have = len(blocks) + len(new_computed_blocks)
        num_new = max(0, cdiv(num_slots, self.block_size) - num_have)
        write_index = num_computed_tokens // self.block_size
        if write_index < len(blocks):
            block = blocks[write_index]
            if block.ref_cnt > 1 and not block.is_null:
                num_new += 1
        return num_new

    def get_num_releasable_blocks(self, seq_id: SeqId, num_computed_tokens: int) -> int:
        """Blocks that ``remove_skipped_blocks`` would put back in the free queue."""
        return 0

    # -- mutation ------------------------------------------------------------------------

    def save_new_computed_blocks(
        self, seq_id: SeqId, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Appends prefix-cache hits (already touched) to a new request's table."""
        blocks = self.req_to_blocks.setdefault(seq_id, [])
        assert not blocks, "prefix hits are only taken by a request with no blocks"
        blocks.extend(new_computed_blocks)
        self.num_cached_blocks[seq_id] = len(new_computed_blocks)

    def remove_skipped_blocks(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """Releases blocks no future token attends to. Full attention: none."""

    def allocate_new_blocks(
        self,
        seq_id: SeqId,
        num_computed_tokens: int,
        num_slots: int,
        copy_ops: list[tuple[BlockId, BlockId]],
    ) -> list[KVCacheBlock]:
        """Gives the request slots for ``num_slots`` tokens; returns new blocks.

        The caller has checked that enough blocks are free. A shared block
        receiving the next token is replaced (copy-on-write, see the class).
        """
        blocks = self.req_to_blocks.setdefault(seq_id, [])
        self.num_cached_blocks.setdefault(seq_id, 0)
        new_blocks: list[KVCacheBlock] = []
        write_index = num_computed_tokens // self.block_size
        if write_index < len(blocks):
            shared = blocks[write_index]
            if shared.ref_cnt > 1 and not shared.is_null:
                (fresh,) = self.pool.get_new_blocks(1)
                blocks[write_index] = fresh
                self.pool.free_blocks((shared,))
                copy_ops.append((shared.block_id, fresh.block_id))
                new_blocks.append(fresh)
        num_new = cdiv(num_slots, self.block_size) - len(blocks)
        if num_new > 0:
            fresh_blocks = self.pool.get_new_blocks(num_new)
            blocks.extend(fresh_blocks)
            new_blocks.extend(fresh_blocks)
        return new_blocks

    def cache_blocks(
        self, seq_id: SeqId, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> None:
        """Enters the request's blocks that ``num_tokens`` tokens fill into the index."""
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        num_cached = self.num_cached_blocks[seq_id]
        if num_full > num_cached:
            self.pool.cache_full_blocks(
                self.req_to_blocks[seq_id], block_hashes, num_cached, num_full, self.group_id
            )
            self.num_cached_blocks[seq_id] = num_full

    def fork(self, parent_id: SeqId, child_id: SeqId, num_computed_tokens: int) -> None:
        """Shares the parent's blocks holding computed tokens with a new child."""
        assert child_id not in self.req_to_blocks, f"{child_id} already has blocks"
        shared = self.req_to_blocks.get(parent_id, [])[: cdiv(num_computed_tokens, self.block_size)]
        self.pool.touch(shared)
        self.req_to_blocks[child_id] = list(shared)
        self.num_cached_blocks[child_id] = min(
            self.num_cached_blocks.get(parent_id, 0), len(shared)
        )

    def free(self, seq_id: SeqId) -> None:
        """Returns every block of the request, tail block first (evicted first)."""
        blocks = self.req_to_blocks.pop(seq_id, None)
        self.num_cached_blocks.pop(seq_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    # -- prefix lookup -------------------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The longest run of cached blocks from the start within ``max_length`` tokens."""
        index = self.pool.cached_blocks[self.group_id]
        hits: list[KVCacheBlock] = []
        append = hits.append
        get = index.get
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = get(block_hash)
            if block is None:
                break
            append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Block tables for layers that attend to the last ``sliding_window`` tokens.

    A token at position p reads keys p - sliding_window + 1 … p. Blocks wholly
    before the first key any future token reads go back to the pool as soon as
    the request's computed tokens pass them; the table keeps null-block
    placeholders there so that logical indices stay put.
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        assert spec.sliding_window is not None
        self.sliding_window = spec.sliding_window
        # Cached blocks a hit needs right before its end: the W - 1 keys the
        # first recomputed token reads.
        self.num_contiguous_blocks = cdiv(self.sliding_window - 1, self.block_size)

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        first_useful_token = num_computed_tokens - self.sliding_window + 1
        return max(0, first_useful_token) // self.block_size

    def get_num_releasable_blocks(self, seq_id: SeqId, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(seq_id, ())
        count = 0
        for i in range(min(self._num_skipped_blocks(num_computed_tokens), len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            if block.ref_cnt == 1:
                count += 1
        return count

    def remove_skipped_blocks(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """Puts blocks that fell out of the window back, latest first.

        Scans back from the last skipped block and stops at the first null
        placeholder (everything before it was released earlier).
        """
        blocks = self.req_to_blocks.get(seq_id)
        if not blocks:
            return
        released: list[KVCacheBlock] = []
        null = self.null_block
        for i in range(min(self._num_skipped_blocks(num_computed_tokens), len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            released.append(block)
            blocks[i] = null
        if released:
            self.pool.free_blocks(released)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The longest hit whose last ``num_contiguous_blocks`` blocks are cached.

        Blocks before that run are null placeholders (outside the window).
        A run that reaches the first block may be shorter.
        """
        index = self.pool.cached_blocks[self.group_id]
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        need = self.num_contiguous_blocks
        if need == 0:  # a window of one token reads nothing from the cache
            return [self.null_block] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = index.get(block_hashes[i])
            if block is None:
                run = 0
                continue
            run += 1
            if run >= need or i == 0:
                end = i + run
                hits = [self.null_block] * i
                hits.extend(index[block_hashes[j]] for j in range(i, end))
                return hits
        return []


def make_manager(spec: KVCacheSpec, pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
    """The manager for a group's attention type."""
    if spec.sliding_window is not None:
        return SlidingWindowManager(spec, pool, group_id)
    return SingleTypeKVCacheManager(spec, pool, group_id)
