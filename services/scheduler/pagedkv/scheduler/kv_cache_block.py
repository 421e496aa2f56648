"""One KV block's metadata, and the intrusive free queue its links thread.

``KVCacheBlock`` is the scheduler's record of one physical block (its KV
lives on the executor): ref count, prefix-cache hash and group, and the two
links of the free queue. ``FreeKVCacheBlockQueue`` owns those links: a
doubly linked list of the blocks no one holds, head first, whose order is
the eviction order (the head is reused next). The ``BlockPool``
(block_pool.py) decides what enters and leaves the queue; only the queue's
methods change the links.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from pagedkv.common.ids import BlockHash, BlockId


class KVCacheBlock:
    """One physical block's metadata. The KV data itself lives on the executor.

    ``prev_free`` / ``next_free`` link the block into the free queue (they are
    None when it is not there). ``block_hash`` and ``group_id`` are set while
    the block is in the prefix-cache index of that KV-cache group;
    ``cached_step`` is the pool's step count when it entered the index (see
    host_tier.py: a block is offloaded only from a step already sent).
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "cached_step",
        "group_id",
        "is_null",
        "next_free",
        "prev_free",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = BlockId(block_id)
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = 0
        self.cached_step = 0
        self.is_null = False
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks, head = next to be reused.

    Every operation is O(1) per block and allocates nothing: the links live in
    the blocks themselves, between two sentinel blocks.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the head block. Raises IndexError when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("the free block queue is empty")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Removes and returns the first ``n`` blocks, head first."""
        if n > self.num_free_blocks:
            raise IndexError(f"asked for {n} blocks, {self.num_free_blocks} are free")
        if n <= 0:
            return []
        out: list[KVCacheBlock] = []
        append = out.append
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks ``block``, which must be in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the tail (reused last)."""
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = tail
        tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Puts ``blocks`` at the tail in the given order."""
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        n = 0
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            n += 1
        last.next_free = tail
        tail.prev_free = last
        self.num_free_blocks += n

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The free blocks, head first."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def check_links(self) -> tuple[set[int], list[str]]:
        """Walks the queue (O(free blocks)): the ids of the blocks in it, and
        what is broken (a back link, a block twice, the count)."""
        errors: list[str] = []
        seen: set[int] = set()
        prev = self._head
        for block in self:
            if block.prev_free is not prev:
                errors.append(f"free queue: broken back link at block {block.block_id}")
            if block.block_id in seen:
                errors.append(f"free queue: block {block.block_id} appears twice")
                break
            seen.add(block.block_id)
            prev = block
        if len(seen) != self.num_free_blocks:
            errors.append(f"free queue: counts {self.num_free_blocks}, holds {len(seen)}")
        return seen, errors
