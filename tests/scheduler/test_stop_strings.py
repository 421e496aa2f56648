"""Stop strings matched on a sequence's text as its tokens arrive, with the
byte-level tokenizer (one token per byte, so a multi-byte character spans
tokens): the matcher releases exactly the text before the stop string that
ends first, however the tokens are split, and holds back only text that may
still become a stop string."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.common.text import IncrementalDetokenizer, TextTokenizer
from pagedkv.executor.tiny_model import EOS_TOKEN_ID, byte_level_tokenizer
from pagedkv.scheduler.stop_strings import Released, StopMatcher

TOKENIZER = TextTokenizer(byte_level_tokenizer())


def ids(text: str) -> list[int]:
    return list(text.encode())


def matcher(stops: Sequence[str], include: bool = False) -> StopMatcher:
    return StopMatcher(IncrementalDetokenizer(TOKENIZER), stops, include)


def push_all(m: StopMatcher, pushes: Sequence[Sequence[int]]) -> tuple[list[str], str | None]:
    """Each push's released text, then the flush's (when no stop string
    matched); and the stop string that matched."""
    released: list[str] = []
    for tokens in pushes:
        out = m.push(tokens)
        released.append(out.text)
        if out.stop is not None:
            return released, out.stop
    return [*released, m.flush()], None


def one_by_one(text: str) -> list[list[int]]:
    return [[token] for token in ids(text)]


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """The reference rule: (end, start, stop) of the stop string that ends
    first in ``text``, the longer one at the same end."""
    found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found, default=None)


def test_a_stop_string_split_across_tokens_ends_the_text_before_it() -> None:
    released, stop = push_all(matcher(["STOP"]), one_by_one("hello STOP world"))
    assert stop == "STOP"
    assert "".join(released) == "hello "
    # Nothing of "STOP" came out while it was being completed.
    assert released == ["h", "e", "l", "l", "o", " ", "", "", "", ""]


def test_include_stop_str_in_output_ends_the_text_after_it() -> None:
    released, stop = push_all(matcher(["STOP"], include=True), one_by_one("hello STOP world"))
    assert (stop, "".join(released)) == ("STOP", "hello STOP")


def test_held_text_that_does_not_become_a_stop_string_is_released() -> None:
    m = matcher(["abc"])
    assert m.push(ids("xab")) == Released("x")
    assert m.held == "ab"
    assert m.push(ids("d")) == Released("abd")
    assert m.held == ""


def test_held_text_comes_out_at_the_end_when_the_sequence_ends_otherwise() -> None:
    m = matcher(["abc"])
    assert m.push(ids("xyzab")) == Released("xyz")
    assert m.flush() == "ab"


def test_the_longest_tail_that_may_become_a_stop_string_is_held() -> None:
    m = matcher(["aab"])
    assert m.push(ids("xaaa")) == Released("xa")  # "aa" may still become "aab"
    assert m.push(ids("b")) == Released("", "aab")


def test_a_stop_string_inside_a_multi_byte_character_matches_once_it_is_whole() -> None:
    released, stop = push_all(matcher(["é"]), one_by_one("caf\u00e9 au lait"))
    assert (stop, "".join(released)) == ("é", "caf")
    # The first byte of "é" (0xC3) is held by the detokenizer, not the matcher.
    assert released == ["c", "a", "f", "", ""]


def test_a_stop_string_spanning_a_multi_byte_character_matches() -> None:
    released, stop = push_all(matcher(["€5"]), one_by_one("costs €5 now"))
    assert (stop, "".join(released)) == ("€5", "costs ")


def test_a_stop_character_whose_bytes_lie_inside_another_character_does_not_match() -> None:
    # "€" is E2 82 AC; U+0082 is C2 82 and U+00AC is C2 AC: their last bytes
    # are in "€", but text is matched by character, never by byte.
    released, stop = push_all(matcher(["\u0082", "\u00ac", "\u20ac!"]), one_by_one("a€b€"))
    assert stop is None
    assert "".join(released) == "a€b€"


def test_of_two_stop_strings_where_one_is_a_prefix_of_the_other_the_shorter_ends_first() -> None:
    for pushes in (one_by_one("xabcd"), [ids("xabcd")]):
        released, stop = push_all(matcher(["abc", "ab"]), pushes)
        assert (stop, "".join(released)) == ("ab", "x")


def test_at_the_same_end_the_longer_stop_string_wins() -> None:
    released, stop = push_all(matcher(["bc", "abc"]), [ids("xabcd")])
    assert (stop, "".join(released)) == ("abc", "x")


def test_the_stop_string_that_ends_first_wins_over_one_that_starts_first() -> None:
    released, stop = push_all(matcher(["xabc", "ab"]), [ids("xabc")])
    assert (stop, "".join(released)) == ("ab", "x")


def test_a_spent_matcher_releases_nothing_more() -> None:
    m = matcher(["b"])
    assert m.push(ids("ab")) == Released("a", "b")
    assert m.push(ids("cd")) == Released("")
    assert m.flush() == ""
    assert m.stopped == "b"


def test_special_tokens_release_no_text() -> None:
    m = matcher(["z"])
    assert m.push([EOS_TOKEN_ID]) == Released("")
    assert m.push(ids("a")) == Released("a")


def test_skipped_tokens_keep_their_held_text_for_the_resumed_stream() -> None:
    m = matcher(["STOP"])
    m.skip(ids("go ST"))  # the broken stream delivered "go " and held "ST"
    assert m.held == "ST"
    assert m.push(ids("OP")) == Released("", "STOP")


def test_skipped_tokens_leave_the_state_pushing_them_would_have() -> None:
    text = "ab€cSTaSTO"
    for cut in range(len(ids(text)) + 1):
        skipped, pushed = matcher(["STOP", "€c!"]), matcher(["STOP", "€c!"])
        skipped.skip(ids(text)[:cut])
        for token in ids(text)[:cut]:
            pushed.push([token])
        assert skipped.held == pushed.held
        assert skipped.push(ids("P")) == pushed.push(ids("P"))


def test_a_stop_string_completed_before_matching_may_begin_is_not_a_match_later() -> None:
    m = matcher(["ab"])
    assert m.push(ids("xa"), match=False) == Released("x")
    assert m.push(ids("b"), match=False) == Released("ab")
    assert m.push(ids("c")) == Released("c")
    assert m.push(ids("ab")) == Released("", "ab")


@pytest.mark.parametrize("include", [False, True])
def test_duplicate_stop_strings_are_one(include: bool) -> None:
    released, stop = push_all(matcher(["ab", "ab"], include), one_by_one("zab"))
    assert (stop, "".join(released)) == ("ab", "zab" if include else "z")


ALPHABET = ["a", "b", "é", "€", "🙂", " "]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    text=st.lists(st.sampled_from(ALPHABET), max_size=24).map("".join),
    stops=st.lists(
        st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3).map("".join),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.integers(0, 96), max_size=12),
    include=st.booleans(),
)
def test_released_text_is_the_text_cut_at_the_first_stop_however_tokens_are_split(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    tokens = ids(text)
    bounds = [0, *sorted(c % (len(tokens) + 1) for c in cuts), len(tokens)]
    pushes = [tokens[lo:hi] for lo, hi in itertools.pairwise(bounds)]
    released, stop = push_all(matcher(stops, include), pushes)
    expected = first_stop(text, stops)
    if expected is None:
        assert stop is None
        assert "".join(released) == text
    else:
        end, start, which = expected
        assert stop == which
        assert "".join(released) == text[: end if include else start]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    text=st.lists(st.sampled_from(ALPHABET), max_size=16).map("".join),
    stops=st.lists(
        st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3).map("".join),
        min_size=1,
        max_size=3,
    ),
)
def test_only_a_tail_that_may_become_a_stop_string_is_held_back(
    text: str, stops: list[str]
) -> None:
    m = matcher(stops)
    out = ""
    tokens = ids(text)
    for k, token in enumerate(tokens, 1):
        released = m.push([token])
        out += released.text
        if released.stop is not None:
            break
        whole = bytes(tokens[:k]).decode(errors="ignore")  # whole characters so far
        held = next(
            whole[i:] for i in range(len(whole) + 1) if any(s.startswith(whole[i:]) for s in stops)
        )
        assert (out, m.held) == (whole[: len(whole) - len(held)], held)
