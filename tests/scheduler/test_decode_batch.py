"""DecodeBatch: the columnar decode path gives the same tables as the per-request one."""

from __future__ import annotations

import pytest

from pagedkv.scheduler.decode_batch import BlockAppends, DecodeBatch, DecodeBatchAllocation
from pagedkv.scheduler.kv_cache_manager import Allocation, BlockCopy, KVCacheManager, TableUpdate
from pagedkv.scheduler.request import Request
from tests.scheduler.factories import admit, decode, manager, window_spec


def prefilled(kv: KVCacheManager, request_id: str, prompt: range, max_tokens: int) -> Request:
    request = kv.make_request(request_id, prompt, max_tokens=max_tokens)
    admit(kv, request)
    request.append_output_token_ids(1000 + len(prompt))  # the first sample
    return request


def test_only_rows_that_start_a_block_reach_the_manager() -> None:
    kv = manager(20)
    a = prefilled(kv, "a", range(3), 50)  # 4 tokens: position 3 is in block 0
    b = prefilled(kv, "b", range(4), 50)  # 5 tokens: position 4 starts block 1
    batch = DecodeBatch(kv, 4)
    batch.add(a)
    batch.add(b)
    result = batch.allocate()
    assert result == DecodeBatchAllocation(True, BlockAppends([b], [1], [3]), [])
    assert kv.get_block_ids("b") == ([2, 3],)
    assert batch.append([7, 8]) == []
    # Tokens wait in the batch until a request leaves or starts a block.
    assert a.num_tokens == 4 and b.num_tokens == 5
    assert batch.sync(0) is a and list(a.token_ids) == [0, 1, 2, 1003, 7]
    assert a.num_computed_tokens == 4


def test_batch_and_per_request_decoding_build_the_same_tables_and_cache() -> None:
    per_request, batched = manager(40), manager(40)
    prompts = {"a": range(5), "b": range(20, 27), "c": range(40, 56)}
    singles = [prefilled(per_request, rid, p, 30) for rid, p in prompts.items()]
    batch = DecodeBatch(batched, 8)
    for rid, p in prompts.items():
        batch.add(prefilled(batched, rid, p, 30))
    for step in range(21):
        for request in singles:
            decode(per_request, request, 2000 + step)
        assert batch.allocate().ok
        assert batch.append([2000 + step] * len(batch)) == []
    for rid in prompts:
        assert per_request.get_block_ids(rid) == batched.get_block_ids(rid)
    finished = batch.remove(range(len(batch)))
    for a, b in zip(
        sorted(singles, key=lambda r: r.request_id),
        sorted(finished, key=lambda r: r.request_id),
        strict=True,
    ):
        assert list(a.token_ids) == list(b.token_ids)
        assert a.num_computed_tokens == b.num_computed_tokens
        per_request.free(a)
        batched.free(b)
    assert set(per_request.pool.cached_blocks[0]) == set(batched.pool.cached_blocks[0])
    assert per_request.check_integrity().ok and batched.check_integrity().ok


def test_blocks_filled_in_the_batch_are_cached_when_the_request_is_freed() -> None:
    kv = manager(20)
    request = prefilled(kv, "a", range(4), 10)
    batch = DecodeBatch(kv, 2)
    batch.add(request)
    for token in range(100, 108):
        assert batch.allocate().ok
        batch.append([token])
    (done,) = batch.remove([0])
    assert done.num_computed_tokens == 12
    kv.free(done)
    probe = kv.make_request("p", list(done.token_ids))
    assert kv.get_computed_blocks(probe).num_tokens == 12


def test_append_reports_rows_that_reach_max_tokens() -> None:
    kv = manager(20)
    batch = DecodeBatch(kv, 4)
    short = prefilled(kv, "short", range(4), 2)
    long = prefilled(kv, "long", range(4), 5)
    batch.add(long)
    batch.add(short)
    assert batch.allocate().ok
    assert batch.append([1, 2]) == [1]
    assert batch.remove([1]) == [short]
    assert short.num_output_tokens == 2
    assert batch.requests == [long]


def test_allocate_reports_a_missing_block_and_pop_takes_the_newest() -> None:
    kv = manager(4)  # 3 usable blocks
    first = prefilled(kv, "first", range(4), 50)
    second = prefilled(kv, "second", range(10, 14), 50)
    batch = DecodeBatch(kv, 4)
    batch.add(first)
    batch.add(second)
    assert kv.pool.get_num_free_blocks() == 1
    result = batch.allocate()
    assert not result.ok  # first took the last block, second found none
    assert result.updates == [(first, Allocation((TableUpdate(1, (3,)),)))]
    victim = batch.pop()
    assert victim is second
    kv.free(victim)
    assert batch.allocate() == DecodeBatchAllocation(True, BlockAppends([], [], []), [])
    assert kv.check_integrity().ok


def test_remove_moves_the_last_row_into_the_hole() -> None:
    kv = manager(20)
    batch = DecodeBatch(kv, 4)
    requests = [prefilled(kv, rid, range(i, i + 3), 50) for i, rid in enumerate("abc")]
    for request in requests:
        batch.add(request)
    batch.allocate()
    batch.append([5, 6, 7])
    assert batch.remove([0]) == [requests[0]]
    assert batch.requests == [requests[2], requests[1]]
    assert batch.sync(0).token_ids[-1] == 7


def test_add_rejects_a_request_with_more_than_one_token_to_compute() -> None:
    kv = manager(20)
    request = kv.make_request("a", range(5))
    with pytest.raises(ValueError, match="one token"):
        DecodeBatch(kv, 2).add(request)


def test_sliding_window_rows_release_blocks_every_step() -> None:
    kv = manager(20, [window_spec(window=4)])
    request = prefilled(kv, "a", range(8), 50)
    batch = DecodeBatch(kv, 2)
    batch.add(request)
    assert batch.allocate().ok
    assert kv.get_block_ids("a") == ([0, 2, 3],)
    assert kv.check_integrity().ok


def test_pending_tokens_go_into_the_request_once_the_buffer_is_full() -> None:
    kv = manager(20)
    request = prefilled(kv, "a", range(4), 50)
    batch = DecodeBatch(kv, 2, pending_width=3)
    batch.add(request)
    for token in (10, 11):
        assert batch.allocate().ok
        batch.append([token])
    assert request.num_tokens == 5  # still waiting in the batch
    assert batch.allocate().ok
    batch.append([12])
    assert list(request.token_ids)[-3:] == [10, 11, 12]


def test_forked_requests_take_the_copy_on_write_path() -> None:
    kv = manager(20)
    parent = prefilled(kv, "p", range(6), 50)
    child = kv.make_request("c", parent.token_ids, max_tokens=50)
    kv.fork(parent, child)
    batch = DecodeBatch(kv, 4)
    batch.add(parent)
    batch.add(child)
    result = batch.allocate()
    assert result.ok and not result.appends.requests
    # The parent writes first into the shared partial block and gets a copy.
    assert result.updates == [(parent, Allocation((TableUpdate(1, (3,)),)))]
    assert kv.take_copy_ops() == [BlockCopy(2, 3)]
    batch.append([7, 8])
    assert batch.allocate() == DecodeBatchAllocation(True, BlockAppends([], [], []), [])
    assert kv.check_integrity().ok


def test_short_pool_serves_every_row_in_row_order_forked_ones_included() -> None:
    kv = manager(6)  # 5 usable blocks
    parent = prefilled(kv, "p", range(20, 24), 50)
    child = kv.make_request("c", parent.token_ids, max_tokens=50)
    kv.fork(parent, child)
    a = prefilled(kv, "a", range(4), 50)
    b = prefilled(kv, "b", range(10, 14), 50)
    admit(kv, kv.make_request("filler", range(30, 34)))
    assert kv.pool.get_num_free_blocks() == 1
    batch = DecodeBatch(kv, 4)
    for request in (parent, child, a, b):
        batch.add(request)  # every row's next token starts a block
    result = batch.allocate()
    # Too few blocks for a and b together: row by row, the forked parent first.
    assert not result.ok
    assert result.appends == BlockAppends([], [], [])
    assert result.updates == [(parent, Allocation((TableUpdate(1, (5,)),)))]
    assert kv.check_integrity().ok


def test_remove_returns_requests_in_the_order_asked_and_pop_needs_a_row() -> None:
    kv = manager(20)
    batch = DecodeBatch(kv, 4)
    requests = [prefilled(kv, rid, range(i, i + 3), 50) for i, rid in enumerate("abc")]
    for request in requests:
        batch.add(request)
    assert batch.remove([0, 2]) == [requests[0], requests[2]]
    assert batch.pop() is requests[1]
    with pytest.raises(IndexError, match="empty"):
        batch.pop()
