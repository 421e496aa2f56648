"""Exact states of the block pool and its free queue."""

from __future__ import annotations

import pytest

from pagedkv.common.ids import BlockHash
from pagedkv.scheduler.block_pool import BlockPool
from pagedkv.scheduler.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def test_free_queue_popleft_append_remove_keep_order_and_count() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft().block_id == 0
    assert ids(queue.popleft_n(2)) == [1, 2]
    queue.remove(blocks[4])
    queue.append(blocks[0])
    queue.append_n([blocks[2], blocks[1]])
    assert [b.block_id for b in queue] == [3, 5, 0, 2, 1]
    assert queue.num_free_blocks == 5
    assert blocks[4].prev_free is None and blocks[4].next_free is None


def test_free_queue_rejects_popping_more_than_it_holds() -> None:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(1)])
    with pytest.raises(IndexError):
        queue.popleft_n(2)
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    assert queue.popleft_n(0) == []


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.check_integrity().ok


def test_blocks_are_handed_out_in_id_order_then_in_free_order() -> None:
    pool = BlockPool(6)
    first = pool.get_new_blocks(3)
    assert ids(first) == [1, 2, 3]
    pool.free_blocks([first[2], first[0]])  # caller's eviction order
    assert queue_ids(pool) == [4, 5, 3, 1]
    assert ids(pool.get_new_blocks(3)) == [4, 5, 3]


def test_shared_block_returns_to_the_queue_only_when_the_last_holder_frees_it() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in queue_ids(pool)
    pool.free_blocks([block])
    assert queue_ids(pool) == [2, 3, 1]


def test_cached_block_stays_findable_while_free_and_is_evicted_when_reused() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = BlockHash(b"h" * 16)
    pool.cache_full_blocks([a, b], [h, BlockHash(b"i" * 16)], 0, 1)
    pool.free_blocks([a, b])
    assert pool.get_cached_block(h) is a and a.ref_cnt == 0
    pool.touch([a])  # a prefix hit takes it back out of the free queue
    assert a.ref_cnt == 1 and queue_ids(pool) == [2]
    pool.free_blocks([a])
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert pool.get_cached_block(h) is None and a.block_hash is None
    assert pool.check_integrity().ok


def test_duplicate_hash_leaves_the_second_block_uncached() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = BlockHash(b"x" * 16)
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    assert pool.num_cached_blocks == 1


def test_caching_disabled_indexes_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [BlockHash(b"x" * 16)], 0, 1)
    assert pool.num_cached_blocks == 0


def test_usage_counts_held_blocks_over_usable_blocks() -> None:
    pool = BlockPool(5)
    pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)


def test_the_peak_counts_the_most_blocks_held_at_once_until_it_is_reset() -> None:
    pool = BlockPool(9)
    assert pool.peak_used_blocks == 0
    first = pool.get_new_blocks(3)
    second = pool.get_new_block()
    pool.free_blocks([*first, second])
    assert pool.peak_used_blocks == 4  # gone before anyone looked, still counted
    pool.cache_full_blocks(first, [BlockHash(bytes([i]) * 16) for i in range(3)], 0, 3)
    pool.reset_peak()
    assert pool.peak_used_blocks == 0  # cached blocks no one holds are free
    pool.touch(first)  # prefix hits take blocks too
    held = pool.get_new_blocks(2)
    pool.free_blocks(first)
    assert pool.peak_used_blocks == 5
    pool.reset_peak()  # starts over from what is held now
    assert pool.peak_used_blocks == 2
    pool.free_blocks(held)
    assert pool.peak_used_blocks == 2 and pool.get_num_free_blocks() == 8


def test_integrity_check_reports_a_leaked_block() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0  # dropped without going back to the queue
    report = pool.check_integrity()
    assert not report.ok
    assert any("leaked" in e for e in report.errors)


def test_reset_prefix_cache_is_refused_while_blocks_are_held() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [BlockHash(b"x" * 16)], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and blocks[0].block_hash is None


def test_pool_needs_room_beyond_the_null_block() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)
