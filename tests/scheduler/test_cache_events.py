"""The prefix-cache index's event log, the executor tags it becomes, and a
pool adopting the tagged blocks of an executor taken over."""

from __future__ import annotations

from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind, tag_changes
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from tests.scheduler.factories import admit, free_ids, full_spec

STORED, REMOVED = CacheEventKind.STORED, CacheEventKind.REMOVED


def recording(num_blocks: int) -> KVCacheManager:
    return KVCacheManager([full_spec()], num_blocks, model_id="test-model", record_events=True)


def event(kind: CacheEventKind, block_id: int, tag: bytes, group_id: int = 0) -> CacheEvent:
    return CacheEvent(kind, BlockId(block_id), BlockHash(tag), group_id)


def test_full_blocks_are_logged_stored_in_order_and_evictions_removed() -> None:
    kv = recording(4)  # 3 usable blocks of 4 tokens
    first = kv.make_request("a", list(range(8)))
    admit(kv, first)
    stored = kv.pool.take_events()
    assert [(e.kind, e.block_id) for e in stored] == [(STORED, 1), (STORED, 2)]
    assert [e.block_hash for e in stored] == first.block_hashes[:2]
    assert kv.pool.take_events() == []  # drained
    kv.free(first)
    second = kv.make_request("b", list(range(100, 112)))
    admit(kv, second)  # takes the free block 3, then evicts 2 and 1 (tail first)
    events = kv.pool.take_events()
    assert [(e.kind, e.block_id) for e in events if e.kind is REMOVED] == [
        (REMOVED, 2),
        (REMOVED, 1),
    ]
    assert {e.block_id for e in events if e.kind is STORED} == {1, 2, 3}


def test_a_pool_without_recording_logs_nothing() -> None:
    kv = KVCacheManager([full_spec()], 4, model_id="test-model")
    admit(kv, kv.make_request("a", list(range(8))))
    assert kv.pool.take_events() == []


def test_reset_prefix_cache_removes_every_cached_block() -> None:
    kv = recording(4)
    request = kv.make_request("a", list(range(8)))
    admit(kv, request)
    kv.free(request)
    kv.pool.take_events()
    assert kv.reset_prefix_cache()
    assert sorted((e.kind, e.block_id) for e in kv.pool.take_events()) == [
        (REMOVED, 1),
        (REMOVED, 2),
    ]


def test_tags_follow_the_last_event_and_every_removal_is_untagged() -> None:
    changes = tag_changes(
        [
            event(STORED, 1, b"h1"),
            event(STORED, 2, b"h2"),
            event(REMOVED, 2, b"h2"),  # stored then evicted: untagged, no tag
            event(REMOVED, 3, b"old"),
            event(STORED, 3, b"new"),  # evicted then stored again: untag, then the new tag
        ]
    )
    assert changes.untag == [2, 3]
    assert [(t.block_id, t.block_hash) for t in changes.tags] == [(1, b"h1"), (3, b"new")]


def test_adopted_blocks_are_hits_and_evicted_last_in_tag_order() -> None:
    source = recording(6)
    request = source.make_request("a", list(range(12)))
    admit(source, request)
    tagged = source.pool.take_events()  # blocks 1, 2, 3 hold the 3 full blocks
    kv = recording(6)
    assert kv.pool.adopt_cached_blocks(tagged) == 3
    assert kv.pool.take_events() == []
    assert free_ids(kv) == [4, 5, 1, 2, 3]
    again = kv.make_request("b", [*range(12), 99])
    assert kv.get_computed_blocks(again).num_tokens == 12
    assert kv.check_integrity().ok


def test_entries_that_cannot_be_adopted_are_logged_removed_so_their_tags_drop() -> None:
    kv = recording(6)
    entries = [
        event(STORED, 1, b"h"),
        event(STORED, 2, b"h"),  # the same hash on a second block
        event(STORED, 9, b"x"),  # out of range: skipped
        event(STORED, 3, b"y", group_id=1),  # no such group: skipped
    ]
    assert kv.pool.adopt_cached_blocks(entries) == 1
    assert kv.pool.take_events() == [event(REMOVED, 2, b"h")]
    assert kv.check_integrity().ok
