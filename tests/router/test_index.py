"""The router's prefix index: exact holders, prefix matches, and prompt hashes
equal to the scheduler's."""

from __future__ import annotations

from array import array

from pagedkv.router.index import PrefixIndex, prompt_block_hashes
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from tests.scheduler.factories import full_spec

H = [bytes([i]) * 16 for i in range(8)]


def test_match_counts_leading_blocks_per_holder() -> None:
    index = PrefixIndex()
    index.add("a", H[:4])
    index.add("b", H[:2])
    index.add("c", [H[1], H[2]])  # not from the start: never a prefix hit
    assert index.match(H[:4]) == {"a": 4, "b": 2}
    assert index.match([H[0], H[5]]) == {"a": 1, "b": 1}
    assert index.match([H[1]]) == {"a": 1, "b": 1, "c": 1}
    assert index.match([]) == {}
    assert index.match([H[7]]) == {}
    assert index.check_integrity() == []


def test_remove_and_clear_drop_exactly_what_they_name() -> None:
    index = PrefixIndex()
    index.add("a", H[:3])
    index.add("b", H[:3])
    index.remove("a", [H[1], H[6]])  # H[6] was never held: ignored
    assert index.match(H[:3]) == {"a": 1, "b": 3}
    assert index.num_blocks("a") == 2
    index.clear("b")
    assert index.match(H[:3]) == {"a": 1}
    assert index.holders() == ["a"]
    assert index.num_blocks() == 2
    index.remove("unknown", H)
    assert index.check_integrity() == []


def test_holder_numbers_are_reused_and_many_holders_match() -> None:
    index = PrefixIndex()
    for n in range(100):  # more holders than a machine word has bits
        index.add(f"h{n}", H[: 1 + n % 5])
    assert index.match(H[:5]) == {f"h{n}": 1 + n % 5 for n in range(100)}
    for n in range(0, 100, 2):
        index.clear(f"h{n}")
    index.add("new", H[:2])  # takes a freed number
    expected = {f"h{n}": 1 + n % 5 for n in range(1, 100, 2)} | {"new": 2}
    assert index.match(H[:5]) == expected
    assert index.check_integrity() == []


def test_replace_is_a_reload() -> None:
    index = PrefixIndex()
    index.add("a", H[:4])
    index.replace("a", [H[5], H[6]])
    assert index.match(H[:4]) == {}
    assert index.match([H[5], H[6]]) == {"a": 2}
    index.replace("b", [])
    assert sorted(index.holders()) == ["a", "b"]
    assert index.check_integrity() == []


def test_prompt_hashes_equal_the_schedulers_block_hashes() -> None:
    manager = KVCacheManager([full_spec(4)], num_blocks=64, model_id="m")
    tokens = list(range(100, 111))  # 2 full blocks and 3 tokens
    request = manager.make_request("r", tokens, cache_salt="s")
    expected = list(request.block_hashes)
    assert prompt_block_hashes(tokens, "m", 4, "s") == expected
    assert len(expected) == 2
    assert prompt_block_hashes(tokens, "m", 4, "") != expected  # the salt is in the root
    assert prompt_block_hashes(array("I", tokens[:3]), "m", 4) == []
