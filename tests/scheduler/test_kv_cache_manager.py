"""Exact states of the KV cache manager: tables, hits, eviction, windows, forks."""

from __future__ import annotations

import pytest

from pagedkv.scheduler.kv_cache_manager import (
    NO_TABLE_CHANGE,
    Allocation,
    BlockCopy,
    KVCacheManager,
    TableUpdate,
)
from pagedkv.scheduler.request import Request
from tests.scheduler.factories import admit, decode, free_ids, full_spec, manager, window_spec


def test_admission_hands_out_blocks_in_order_and_reports_the_table() -> None:
    kv = manager(10)
    request = kv.make_request("a", range(10))
    computed = kv.get_computed_blocks(request)
    assert computed.num_tokens == 0
    allocation = kv.allocate_slots(request, 10, computed)
    assert allocation == Allocation((TableUpdate(0, (1, 2, 3)),))
    assert kv.get_block_ids("a") == ([1, 2, 3],)
    assert kv.pool.get_num_free_blocks() == 6


def test_decode_in_a_block_with_room_changes_no_table() -> None:
    kv = manager(10)
    request = kv.make_request("a", range(6))
    admit(kv, request)
    request.append_output_token_ids(100)
    assert kv.allocate_slots(request, 1) is NO_TABLE_CHANGE
    request.num_computed_tokens = 7
    request.append_output_token_ids(101)
    assert kv.allocate_slots(request, 1) is NO_TABLE_CHANGE
    request.num_computed_tokens = 8
    request.append_output_token_ids(102)
    assert kv.allocate_slots(request, 1) == Allocation((TableUpdate(2, (3,)),))


def test_freed_tail_blocks_are_evicted_first() -> None:
    kv = manager(8)
    request = kv.make_request("a", range(12))
    admit(kv, request)
    assert kv.get_block_ids("a") == ([1, 2, 3],)
    kv.free(request)
    assert free_ids(kv) == [4, 5, 6, 7, 3, 2, 1]


def test_least_recently_freed_request_is_evicted_before_later_ones() -> None:
    kv = manager(5)
    first = kv.make_request("a", range(100, 108))
    second = kv.make_request("b", range(200, 208))
    admit(kv, first)
    admit(kv, second)
    kv.free(first)
    kv.free(second)
    assert free_ids(kv) == [2, 1, 4, 3]
    # Taking two blocks evicts all of the first request's cached blocks ...
    third = kv.make_request("c", range(300, 308))
    admit(kv, third)
    assert kv.get_block_ids("c") == ([2, 1],)
    # ... while the second request's prefix still hits.
    again = kv.make_request("b2", [*range(200, 208), 7])
    assert kv.get_computed_blocks(again).num_tokens == 8
    lost = kv.make_request("a2", [*range(100, 108), 7])
    assert kv.get_computed_blocks(lost).num_tokens == 0


def test_prefix_hit_covers_whole_shared_blocks() -> None:
    kv = manager(20)
    admit(kv, kv.make_request("a", range(10)))
    request = kv.make_request("b", [*range(9), 99, 98, 97])
    assert kv.get_computed_blocks(request).num_tokens == 8
    assert kv.prefix_cache_stats.hits == 8


def test_full_hit_still_recomputes_the_last_token() -> None:
    kv = manager(20)
    admit(kv, kv.make_request("a", range(8)))
    same = kv.make_request("b", range(8))
    computed = kv.get_computed_blocks(same)
    assert computed.num_tokens == 4  # the second block holds the last token
    allocation = kv.allocate_slots(same, 4, computed)
    assert allocation == Allocation((TableUpdate(0, (1, 3)),))
    assert same.num_computed_tokens == 4


def test_partial_blocks_are_never_cached() -> None:
    kv = manager(20)
    request = kv.make_request("a", range(6))
    admit(kv, request)
    assert kv.pool.num_cached_blocks == 1
    kv.free(request)
    probe = kv.make_request("b", [*range(6), 1, 2, 3])
    assert kv.get_computed_blocks(probe).num_tokens == 4


def test_cache_salt_and_model_keep_prefixes_apart() -> None:
    kv = manager(20)
    admit(kv, kv.make_request("a", range(9), cache_salt="tenant-a"))
    other_tenant = kv.make_request("b", range(9), cache_salt="tenant-b")
    same_tenant = kv.make_request("c", range(9), cache_salt="tenant-a")
    assert kv.get_computed_blocks(other_tenant).num_tokens == 0
    assert kv.get_computed_blocks(same_tenant).num_tokens == 8
    # Another model's requests hash the same tokens to other blocks.
    other_model = KVCacheManager([full_spec()], 20, model_id="another-model")
    unsalted = kv.make_request("d", range(9))
    assert other_model.make_request("e", range(9)).block_hashes[0] != unsalted.block_hashes[0]


def test_caching_disabled_never_hits() -> None:
    kv = manager(20, enable_caching=False)
    admit(kv, kv.make_request("a", range(9)))
    assert kv.get_computed_blocks(kv.make_request("b", range(9))).num_tokens == 0
    assert kv.pool.num_cached_blocks == 0


def test_preempted_request_hits_its_own_blocks_on_readmission() -> None:
    kv = manager(20)
    request = kv.make_request("a", range(10))
    admit(kv, request)
    for token in (50, 51, 52):
        decode(kv, request, token)
    table = kv.get_block_ids("a")[0]
    kv.free(request)  # preemption: blocks go back, full ones stay cached
    request.num_computed_tokens = 0
    computed = kv.get_computed_blocks(request)
    assert computed.num_tokens == 12
    assert [b.block_id for b in computed.blocks[0]] == table[:3]


def test_failed_allocation_leaves_no_trace() -> None:
    kv = manager(6)
    admit(kv, kv.make_request("a", range(100, 108)))
    kv.free(kv.make_request("a", [0]))  # unknown request: a no-op
    holder = kv.make_request("h", range(12))
    admit(kv, holder)
    before = (free_ids(kv), [b.ref_cnt for b in kv.pool.blocks], dict(kv.pool.cached_blocks[0]))
    stats = kv.prefix_cache_stats
    big = kv.make_request("big", [*range(100, 108), *range(20)])
    computed = kv.get_computed_blocks(big)
    assert computed.num_tokens == 8
    assert kv.allocate_slots(big, big.num_tokens - 8, computed) is None
    after = (free_ids(kv), [b.ref_cnt for b in kv.pool.blocks], dict(kv.pool.cached_blocks[0]))
    assert after == before
    assert kv.get_block_ids("big") == ([],)
    assert big.num_computed_tokens == 0
    assert kv.prefix_cache_stats.requests == stats.requests + 1
    assert kv.check_integrity().ok


def test_scheduling_more_tokens_than_the_request_has_is_an_error() -> None:
    kv = manager(10)
    request = kv.make_request("a", range(4))
    with pytest.raises(ValueError, match="scheduled"):
        kv.allocate_slots(request, 5)


def forked_pair(kv: KVCacheManager, prompt_len: int) -> tuple[Request, Request]:
    """A prefilled parent with one sampled token, and a child forked from it."""
    parent = kv.make_request("p", range(prompt_len))
    admit(kv, parent)
    parent.append_output_token_ids(100)
    child = kv.make_request("c", parent.token_ids)
    kv.fork(parent, child)
    return parent, child


def test_fork_shares_blocks_and_copies_the_partial_block_on_first_write() -> None:
    kv = manager(12)
    parent, child = forked_pair(kv, 6)
    assert kv.get_block_ids("c") == kv.get_block_ids("p") == ([1, 2],)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2)] == [2, 2]
    assert child.num_computed_tokens == 6
    assert kv.num_blocks_held("c") == 2 and kv.pool.usage == pytest.approx(2 / 11)

    # The child writes first: it gets a fresh copy of the shared partial block.
    assert kv.allocate_slots(child, 1) == Allocation((TableUpdate(1, (3,)),))
    assert kv.take_copy_ops() == [BlockCopy(2, 3)]
    assert kv.get_block_ids("c") == ([1, 3],)
    assert kv.pool.blocks[2].ref_cnt == 1
    # The parent now owns block 2 alone and writes into it in place.
    assert kv.allocate_slots(parent, 1) is NO_TABLE_CHANGE
    assert kv.take_copy_ops() == []
    assert kv.check_integrity().ok


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    kv = manager(12)
    parent, child = forked_pair(kv, 8)
    assert kv.allocate_slots(child, 1) == Allocation((TableUpdate(2, (3,)),))
    assert kv.allocate_slots(parent, 1) == Allocation((TableUpdate(2, (4,)),))
    assert kv.take_copy_ops() == []


def test_fork_rejects_a_child_with_other_tokens() -> None:
    kv = manager(12)
    parent = kv.make_request("p", range(6))
    admit(kv, parent)
    with pytest.raises(ValueError, match="fork"):
        kv.fork(parent, kv.make_request("c", range(1, 7)))


def test_freeing_both_sides_of_a_fork_returns_every_block() -> None:
    kv = manager(12)
    parent, child = forked_pair(kv, 6)
    decode(kv, child, 61)
    kv.free(parent)
    kv.free(child)
    assert kv.pool.get_num_free_blocks() == 11
    assert kv.check_integrity().ok


def test_sliding_window_returns_blocks_that_fell_out_of_the_window() -> None:
    kv = manager(12, [window_spec(window=5)])
    request = kv.make_request("a", range(14))
    admit(kv, request)
    assert kv.get_block_ids("a") == ([1, 2, 3, 4],)
    request.append_output_token_ids(14)
    # Token 14 reads keys 10..14: blocks 0 and 1 (tokens 0..7) are out.
    assert kv.allocate_slots(request, 1) is NO_TABLE_CHANGE
    assert kv.get_block_ids("a") == ([0, 0, 3, 4],)
    assert free_ids(kv)[-2:] == [2, 1]
    assert kv.num_blocks_held("a") == 2
    assert kv.check_integrity().ok


def test_sliding_window_hit_needs_only_the_blocks_inside_the_window() -> None:
    kv = manager(20, [window_spec(window=6)])
    first = kv.make_request("a", range(17))
    admit(kv, first)
    assert kv.get_block_ids("a") == ([1, 2, 3, 4, 5],)
    kv.free(first)
    probe = kv.make_request("b", range(17))
    computed = kv.get_computed_blocks(probe)
    # Token 16 reads keys 11..16: blocks 2 and 3 suffice, the rest are placeholders.
    assert computed.num_tokens == 16
    assert [b.block_id for b in computed.blocks[0]] == [0, 0, 3, 4]
    assert kv.allocate_slots(probe, 1, computed) == Allocation((TableUpdate(0, (0, 0, 3, 4, 6)),))


def test_groups_agree_on_one_hit_length() -> None:
    kv = manager(40, [full_spec(), window_spec(window=3)])
    first = kv.make_request("a", range(13))
    admit(kv, first)
    assert kv.get_block_ids("a") == ([1, 2, 3, 4], [5, 6, 7, 8])
    kv.free(first)
    computed = kv.get_computed_blocks(kv.make_request("b", range(13)))
    assert computed.num_tokens == 12
    assert [b.block_id for b in computed.blocks[0]] == [1, 2, 3]
    assert [b.block_id for b in computed.blocks[1]] == [0, 0, 7]


def test_a_window_group_miss_shortens_the_hit_of_every_group() -> None:
    kv = manager(40, [full_spec(), window_spec(window=3)])
    first = kv.make_request("a", range(13))
    admit(kv, first)
    kv.free(first)
    # Evict only the window group's block for tokens 8..11 (block 7).
    block = kv.pool.blocks[7]
    kv.pool.free_block_queue.remove(block)
    kv.pool._evict_all((block,))
    kv.pool.free_block_queue.append(block)
    computed = kv.get_computed_blocks(kv.make_request("b", range(13)))
    # The window group can end a hit at 8 (block 6 holds keys 4..7), not at 12.
    assert computed.num_tokens == 8
    assert [b.block_id for b in computed.blocks[0]] == [1, 2]
    assert [b.block_id for b in computed.blocks[1]] == [0, 6]
    assert kv.check_integrity().ok


def test_allocate_decode_slots_stops_at_the_first_request_without_a_block() -> None:
    kv = manager(5)
    a = kv.make_request("a", range(4))
    b = kv.make_request("b", range(10, 13))
    c = kv.make_request("c", range(20, 24))
    for request in (a, b, c):
        admit(kv, request)
        request.append_output_token_ids(99)
    assert kv.get_block_ids("c") == ([3],)
    result = kv.allocate_decode_slots([a, b, c])
    # a needs a new block and gets the last one; b has room; c needs one, none is left.
    assert result.num_allocated == 2
    assert result.updates == [(0, Allocation((TableUpdate(1, (4,)),)))]
    assert kv.get_block_ids("c") == ([3],)
    kv.free(b)
    retry = kv.allocate_decode_slots([a, b, c], start=2)
    assert retry.num_allocated == 1
    assert retry.updates == [(2, Allocation((TableUpdate(1, (2,)),)))]
    assert kv.check_integrity().ok


def test_kv_cache_specs_must_share_one_block_size() -> None:
    with pytest.raises(ValueError, match="block size"):
        manager(10, [full_spec(4), full_spec(8)])


# Two groups (full attention first, then a sliding window; block size 2, window
# 3) over 8 usable blocks: every group takes its hits and releases what left
# its window before any group takes fresh blocks.


def test_hybrid_allocation_that_fits_after_window_release_succeeds() -> None:
    kv = manager(9, [full_spec(2), window_spec(window=3, block_size=2)])
    request = kv.make_request("a", list(range(12)))
    assert kv.allocate_slots(request, 8, kv.get_computed_blocks(request)) is not None
    request.num_computed_tokens = 8
    assert kv.pool.get_num_free_blocks() == 0
    # Tokens 8-9 need one block per group; keys 0-5 left the window: 3 blocks.
    assert kv.allocate_slots(request, 2) is not None
    assert kv.check_integrity().ok
    assert kv.get_block_ids("a")[1][:3] == [0, 0, 0]


def test_hybrid_prefix_hit_blocks_stay_out_of_the_other_groups_tables() -> None:
    kv = manager(9, [full_spec(2), window_spec(window=3, block_size=2)])
    first = kv.make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8, kv.get_computed_blocks(first)) is not None
    first.num_computed_tokens = 8
    kv.free(first)  # free queue: the full group's 4 3 2 1, then the window group's 8 7 6 5
    second = kv.make_request("b", [*range(8), 99])
    hit = kv.get_computed_blocks(second)
    assert hit.num_tokens == 8
    window_hit = hit.blocks[1][3]
    assert kv.allocate_slots(second, 1, hit) is not None
    full_table, window_table = kv.get_block_ids("b")
    assert window_table[3] == window_hit.block_id
    assert window_hit.block_id not in full_table
    assert kv.pool.get_cached_block(second.block_hashes[3], group_id=1) is window_hit
    assert kv.check_integrity().ok


def test_integrity_check_reports_a_block_held_at_two_places() -> None:
    kv = manager(10)
    request = kv.make_request("a", range(8))
    admit(kv, request)
    table = kv.managers[0].req_to_blocks["a"]
    table[1] = table[0]  # one block at two logical indices
    table[0].ref_cnt += 1
    kv.pool.blocks[2].ref_cnt -= 1
    kv.pool.free_block_queue.append(kv.pool.blocks[2])
    report = kv.check_integrity()
    assert any("held at" in e for e in report.errors)


def test_a_blocks_bytes_count_an_int8_blocks_scales() -> None:
    from pagedkv.common.kv_cache_spec import KVCacheSpec

    def spec(dtype: str) -> KVCacheSpec:
        return KVCacheSpec(block_size=16, num_layers=2, num_kv_heads=4, head_size=64, dtype=dtype)

    assert spec("bfloat16").page_size_bytes == 2 * 16 * 4 * 64 * 2
    assert spec("float8_e4m3fn").page_size_bytes == 2 * 16 * 4 * 64
    # A float16 scale per token and KV head beside each value's byte: 1.94x
    # bf16's blocks in the same memory at head size 64.
    assert spec("int8").page_size_bytes == 2 * 16 * 4 * (64 + 2)
    assert spec("int8").bytes_per_block == 2 * spec("int8").page_size_bytes
    with pytest.raises(ValueError, match=r"KVCacheSpec\.dtype 'int4' is not one of"):
        spec("int4")
