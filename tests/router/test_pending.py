"""Prompts the router just placed count as held by their executor until
they expire, so requests sharing a prefix follow each other before the KV
events arrive."""

from __future__ import annotations

from pagedkv.router.pending import PendingPrompts, merged


def hashes(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_a_placed_prompt_is_matched_by_its_leading_blocks_until_it_expires() -> None:
    pending = PendingPrompts(ttl_ms=100)
    pending.add("x", hashes("p0", "p1", "s1"), now_ms=1_000)
    assert pending.match(hashes("p0", "p1", "s2"), now_ms=1_050) == {"x": 2}
    assert pending.match(hashes("q0"), now_ms=1_050) == {}
    assert pending.match(hashes("p0", "p1", "s2"), now_ms=1_100) == {}
    assert len(pending) == 0


def test_an_entry_expiring_keeps_the_blocks_a_later_entry_named() -> None:
    pending = PendingPrompts(ttl_ms=100)
    pending.add("x", hashes("p0", "p1", "a"), now_ms=0)
    pending.add("x", hashes("p0", "p1", "b"), now_ms=60)
    pending.add("y", hashes("p0"), now_ms=60)
    assert pending.match(hashes("p0", "p1", "a"), now_ms=100) == {"x": 2, "y": 1}
    assert pending.match(hashes("p0", "p1", "b"), now_ms=100) == {"x": 3, "y": 1}
    assert pending.match(hashes("p0", "p1", "b"), now_ms=160) == {}


def test_merged_takes_the_longer_of_held_and_expected() -> None:
    assert merged({"x": 4, "y": 1}, {"y": 3, "z": 2}) == {"x": 4, "y": 3, "z": 2}
