"""Prompt text to token ids, and output tokens to streamed text deltas."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pagedkv.common.text import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    TextTokenizer,
)
from pagedkv.executor.tiny_model import byte_level_tokenizer

BOS, EOS, PAD = 256, 257, 258


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    loaded = TextTokenizer.from_model_dir(model_dir)
    assert loaded is not None
    return loaded


class CountingTokenizer(TextTokenizer):
    """Records the length of every decoded id list."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
        self.decoded_lengths: list[int] = []

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded_lengths.append(len(ids))
        return super().decode(ids)


def stream(tokenizer: TextTokenizer, chunks: Sequence[Sequence[int]]) -> list[str]:
    """The deltas of pushing ``chunks`` in order, then the flush."""
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(chunk) for chunk in chunks]
    return [*deltas, detok.flush()]


def one_by_one(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


def chunked(ids: Sequence[int], cuts: Sequence[int]) -> Iterator[list[int]]:
    bounds = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    for lo, hi in itertools.pairwise(bounds):
        yield list(ids[lo:hi])


# --- TextTokenizer ---------------------------------------------------------------


def test_model_dir_without_tokenizer_json_gives_none(tmp_path: Path) -> None:
    assert TextTokenizer.from_model_dir(tmp_path) is None
    assert TextTokenizer.from_model_dir(str(tmp_path)) is None


def test_loads_tokenizer_json_from_model_dir(tokenizer: TextTokenizer) -> None:
    assert tokenizer.vocab_size == 259


@pytest.mark.parametrize("text", ["", "hello, world", "héllo 你好 🙂\n\ttabs"])
def test_encode_is_utf8_bytes_and_decode_gives_the_text_back(
    tokenizer: TextTokenizer, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_encode_adds_no_special_tokens_and_decode_skips_them(tokenizer: TextTokenizer) -> None:
    assert tokenizer.encode("hi") == [104, 105]
    assert tokenizer.encode("hi<eos>") == [104, 105, EOS]
    assert tokenizer.decode([BOS, 104, PAD, 105, EOS]) == "hi"


# --- IncrementalDetokenizer: exact deltas ----------------------------------------


def test_ascii_gives_one_character_per_token(tokenizer: TextTokenizer) -> None:
    assert stream(tokenizer, one_by_one(b"abc ")) == ["a", "b", "c", " ", ""]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("é", ["", "é"]),
        ("你好", ["", "", "你", "", "", "好"]),
        ("🙂", ["", "", "", "🙂"]),
        ("a🙂b", ["a", "", "", "", "🙂", "b"]),
    ],
)
def test_multibyte_character_is_held_until_its_last_byte(
    tokenizer: TextTokenizer, text: str, expected: list[str]
) -> None:
    assert stream(tokenizer, one_by_one(tokenizer.encode(text))) == [*expected, ""]


def test_special_tokens_are_skipped_even_inside_a_character(tokenizer: TextTokenizer) -> None:
    e_acute = list("é".encode())
    ids = [BOS, 104, e_acute[0], PAD, e_acute[1], EOS]
    assert stream(tokenizer, one_by_one(ids)) == ["", "h", "", "", "é", "", ""]


def test_push_of_nothing_gives_nothing(tokenizer: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push([]) == ""
    assert detok.num_tokens == 0


def test_unfinished_character_at_the_end_comes_out_in_flush(tokenizer: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([b]) for b in "你".encode()[:2]] == ["", ""]
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.flush() == ""
    assert detok.num_tokens == 2


def test_invalid_byte_comes_out_with_the_next_valid_text(tokenizer: TextTokenizer) -> None:
    assert stream(tokenizer, [[0xFF], [ord("a")]]) == ["", REPLACEMENT_CHAR + "a", ""]


def test_long_invalid_run_is_let_out_before_the_end(tokenizer: TextTokenizer) -> None:
    deltas = stream(tokenizer, one_by_one([0xFF] * 12))
    assert "".join(deltas) == REPLACEMENT_CHAR * 12
    assert len("".join(deltas[:-1])) >= 8  # not all held until flush


def test_invalid_run_before_an_unfinished_character_keeps_the_character(
    tokenizer: TextTokenizer,
) -> None:
    ids = [0xFF] * 6 + list("你".encode())
    deltas = stream(tokenizer, one_by_one(ids))
    assert "".join(deltas[:-1]) == REPLACEMENT_CHAR * 6 + "你"
    assert deltas[-1] == ""


def test_prompt_tail_is_context_not_output(tokenizer: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("prompt é"))
    assert [detok.push([b]) for b in "ü!".encode()] == ["", "ü", "!"]
    assert detok.num_tokens == 3


def test_decode_window_stays_short(tokenizer: TextTokenizer, model_dir: Path) -> None:
    counting = CountingTokenizer(model_dir)
    detok = IncrementalDetokenizer(counting)
    text = "streamed 你好 🙂 " * 100
    deltas = [detok.push(chunk) for chunk in chunked(tokenizer.encode(text), [700])]
    deltas += [detok.push([b]) for b in tokenizer.encode(text)]
    assert "".join(deltas) + detok.flush() == text + text
    assert len(counting.decoded_lengths) <= 2 * (2 + len(tokenizer.encode(text)))
    assert max(counting.decoded_lengths[4:]) <= 10


# --- IncrementalDetokenizer: properties -------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(max_size=40),
    cuts=st.lists(st.integers(min_value=0), max_size=12),
    specials=st.lists(st.tuples(st.integers(min_value=0), st.sampled_from([BOS, EOS, PAD]))),
)
def test_valid_text_in_any_chunking_streams_whole_characters(
    tokenizer: TextTokenizer,
    text: str,
    cuts: list[int],
    specials: list[tuple[int, int]],
) -> None:
    assume(not any(spelled in text for spelled in ("<bos>", "<eos>", "<pad>")))
    assume(REPLACEMENT_CHAR not in text)  # a U+FFFD of the text itself is no split character
    ids = tokenizer.encode(text)
    for position, special in specials[:6]:
        ids.insert(position % (len(ids) + 1), special)
    deltas = stream(tokenizer, list(chunked(ids, cuts)))
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(
        st.one_of(st.integers(0, 255), st.sampled_from(list("é你🙂".encode()))), max_size=40
    ),
    cuts=st.lists(st.integers(min_value=0), max_size=12),
)
def test_any_bytes_in_any_chunking_concatenate_to_the_full_decode(
    tokenizer: TextTokenizer, data: list[int], cuts: list[int]
) -> None:
    deltas = stream(tokenizer, list(chunked(data, cuts)))
    assert "".join(deltas) == tokenizer.decode(data)
