"""The block core's integrity audit finds each kind of broken state.

GetStats runs the audit (audits.py: for every call on an executor with no
request, at most once an interval on a busy one). The holders' audit skips
its walk over the whole pool when the held blocks' count and ref counts
agree with the pool's (holders_audit.py), so each corruption below must
still come out of the audit as an error naming it, and a sound state pass
with its counts. A block whose group is out of range is reported, not
raised.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.common.ids import BlockHash
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from tests.scheduler.factories import admit, manager


def cached_manager() -> KVCacheManager:
    """A pool of 12 blocks: request "a" holds 3 (2 of them cached), "b"
    held 2 more and was freed (they wait in the free queue, cached)."""
    kv = manager(12)
    admit(kv, kv.make_request("a", range(10)))  # blocks of 4 tokens: 2 full, 1 partial
    b = kv.make_request("b", range(100, 108))
    admit(kv, b)
    kv.free(b)
    return kv


def leak(kv: KVCacheManager) -> None:
    (block,) = kv.pool.get_new_blocks(1)
    block.ref_cnt = 0  # dropped without going back to the queue


def free_but_held(kv: KVCacheManager) -> None:
    next(iter(kv.pool.free_block_queue)).ref_cnt = 1


def negative_ref(kv: KVCacheManager) -> None:
    kv.managers[0].req_to_blocks["a"][0].ref_cnt = -1


def broken_back_link(kv: KVCacheManager) -> None:
    free = list(kv.pool.free_block_queue)
    free[2].prev_free = free[0]


def cycle(kv: KVCacheManager) -> None:
    free = list(kv.pool.free_block_queue)
    free[3].next_free = free[1]  # the walk never reaches the tail


def short_count(kv: KVCacheManager) -> None:
    kv.pool.free_block_queue.num_free_blocks -= 1


def null_in_queue(kv: KVCacheManager) -> None:
    kv.pool.free_block_queue.append(kv.pool.null_block)
    kv.pool.free_block_queue.num_free_blocks -= 1  # the count as if it were not there


def unindexed_hash(kv: KVCacheManager) -> None:
    next(iter(kv.pool.free_block_queue)).block_hash = BlockHash(b"z" * 16)


def index_entry_differs(kv: KVCacheManager) -> None:
    index = kv.pool.cached_blocks[0]
    block = next(iter(index.values()))
    block.group_id = 1


def hash_carried_twice(kv: KVCacheManager) -> None:
    # A block not indexed carries an indexed block's hash.
    index = kv.pool.cached_blocks[0]
    block_hash = next(iter(index))
    held = kv.managers[0].req_to_blocks["a"][2]  # the partial block: no hash
    held.block_hash = block_hash


def ref_without_holder(kv: KVCacheManager) -> None:
    kv.managers[0].req_to_blocks["a"][0].ref_cnt += 1


def holder_without_ref(kv: KVCacheManager) -> None:
    table = kv.managers[0].req_to_blocks["a"]
    table.append(next(iter(kv.pool.free_block_queue)))  # held, but still free with ref 0


CORRUPTIONS: dict[str, tuple[Callable[[KVCacheManager], None], str]] = {
    "leaked block": (leak, "leaked"),
    "free block with a ref count": (free_but_held, "free with ref_cnt"),
    "negative ref count": (negative_ref, "ref_cnt -1"),
    "broken back link": (broken_back_link, "broken back link"),
    "cycle in the free queue": (cycle, "appears twice"),
    "free count too small": (short_count, "counts"),
    "null block in the free queue": (null_in_queue, "null block is in the free queue"),
    "hash not indexed": (unindexed_hash, "carries a hash the index lacks"),
    "index entry differs": (index_entry_differs, "differs"),
    "one hash on two blocks": (hash_carried_twice, "carries a hash the index lacks"),
    "ref count without a holder": (ref_without_holder, "holders"),
    "holder without a ref count": (holder_without_ref, "holders"),
}


def test_a_sound_pool_passes_with_its_counts() -> None:
    kv = cached_manager()
    report = kv.check_integrity()
    assert report.ok, report.errors
    assert (report.num_blocks, report.num_used, report.num_free) == (12, 3, 8)
    assert report.num_cached == 4


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_the_audit_reports_each_kind_of_broken_state(name: str) -> None:
    corrupt, message = CORRUPTIONS[name]
    kv = cached_manager()
    assert kv.check_integrity().ok
    corrupt(kv)
    report = kv.check_integrity()
    assert not report.ok
    assert any(message in error for error in report.errors), report.errors
