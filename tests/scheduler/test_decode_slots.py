"""``allocate_decode_slots``: the decode path gives the tables and cache of per-request slots."""

from __future__ import annotations

from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import Request
from tests.scheduler.factories import admit, decode, manager


def prefilled(kv: KVCacheManager, seq_id: str, prompt: range, max_tokens: int) -> Request:
    request = kv.make_request(seq_id, prompt, max_tokens=max_tokens)
    admit(kv, request)
    request.append_output_token_ids(1000 + len(prompt))  # the first sample
    return request


def index(kv: KVCacheManager) -> dict[BlockHash, BlockId]:
    """The prefix-cache index as hash -> block id, in insertion order."""
    return {h: b.block_id for h, b in kv.pool.cached_blocks[0].items()}


def step(kv: KVCacheManager, requests: list[Request], token_id: int) -> None:
    """One decode step of ``requests`` through ``allocate_decode_slots``."""
    assert kv.allocate_decode_slots(requests).num_allocated == len(requests)
    for request in requests:
        request.num_computed_tokens += 1
        request.append_output_token_ids(token_id)


def test_decode_slots_and_per_request_slots_build_the_same_tables_and_cache() -> None:
    per_request, stepped = manager(40), manager(40)
    prompts = {"a": range(5), "b": range(20, 27), "c": range(40, 56)}
    singles = [prefilled(per_request, rid, p, 30) for rid, p in prompts.items()]
    together = [prefilled(stepped, rid, p, 30) for rid, p in prompts.items()]
    for i in range(21):
        for request in singles:
            decode(per_request, request, 2000 + i)
        step(stepped, together, 2000 + i)
        for rid in prompts:
            assert per_request.get_block_ids(rid) == stepped.get_block_ids(rid)
        assert index(per_request) == index(stepped)
    for a, b in zip(singles, together, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        assert a.num_computed_tokens == b.num_computed_tokens
        per_request.free(a)
        stepped.free(b)
    assert list(index(per_request).items()) == list(index(stepped).items())
    assert per_request.check_integrity().ok and stepped.check_integrity().ok


def test_a_block_filled_while_decoding_is_cached_before_the_request_ends() -> None:
    kv = manager(20)
    request = prefilled(kv, "a", range(4), 10)  # block 0 full, token 4 starts block 1
    for token in range(100, 104):
        step(kv, [request], token)
    # Tokens 4..7 fill block 1; the request still runs.
    probe = kv.make_request("p", [*request.token_ids[:8], 7])
    assert kv.get_computed_blocks(probe).num_tokens == 8


def test_covers_says_when_a_requests_blocks_already_hold_its_next_tokens() -> None:
    kv = manager(20)
    request = prefilled(kv, "a", range(10), 40)  # 11 tokens; 10 computed, in 3 blocks of 4
    blocks = kv.get_block_ids("a")
    assert len(blocks[0]) == 3
    assert kv.covers(request, 12) and not kv.covers(request, 13)
    assert kv.allocate_slots(request, 0, num_lookahead_tokens=12 - 10) is not None
    assert kv.get_block_ids("a") == blocks  # covered: nothing changed
    assert kv.allocate_slots(request, 0, num_lookahead_tokens=13 - 10) is not None
    assert kv.covers(request, 16) and len(kv.get_block_ids("a")[0]) == 4
