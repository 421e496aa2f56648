"""Text prompts: refused before any encoding when they cannot fit the model,
encoded on worker threads that leave the event loop running."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pagedkv.common.errors import InvalidArgument
from pagedkv.common.text import TextTokenizer
from pagedkv.common.text_prompts import PromptEncoder, max_prompt_chars
from pagedkv.executor.tiny_model import byte_level_tokenizer

MAX_MODEL_LEN = 128


class RecordingTokenizer(TextTokenizer):
    """Records the thread of every encode; ``started`` is set as one starts."""

    def __init__(self) -> None:
        super().__init__(byte_level_tokenizer())
        self.encoded_on: list[str] = []
        self.started = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.encoded_on.append(threading.current_thread().name)
        self.started.set()
        return super().encode(text)


def test_the_bound_is_max_model_len_times_the_longest_token() -> None:
    tokenizer = RecordingTokenizer()
    assert tokenizer.longest_token_chars == len("<bos>")  # the bytes are one character each
    assert max_prompt_chars(tokenizer, MAX_MODEL_LEN) == MAX_MODEL_LEN * 5


def test_text_past_the_bound_is_refused_naming_the_field_without_encoding() -> None:
    tokenizer = RecordingTokenizer()
    encoder = PromptEncoder()
    text = "x" * (max_prompt_chars(tokenizer, MAX_MODEL_LEN) + 1)
    with pytest.raises(InvalidArgument, match=r"^prompt\.text: 641 characters") as refused:
        asyncio.run(encoder.encode(text, tokenizer, MAX_MODEL_LEN))
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert tokenizer.encoded_on == []
    encoder.close()


def test_text_within_the_bound_is_encoded_on_a_worker_thread() -> None:
    tokenizer = RecordingTokenizer()
    encoder = PromptEncoder()
    text = "<bos>" * MAX_MODEL_LEN  # exactly the bound, and it fits
    ids = asyncio.run(encoder.encode(text, tokenizer, MAX_MODEL_LEN))
    assert ids == [256] * MAX_MODEL_LEN
    assert len(tokenizer.encoded_on) == 1
    assert tokenizer.encoded_on[0].startswith("pagedkv-encode")
    encoder.close()


def test_the_event_loop_runs_while_a_long_text_encodes() -> None:
    """The tokenizer releases the GIL as it encodes: a task on the loop keeps
    waking while a 300 KB text is encoded (``Tokenizer.encode`` holds the
    GIL: with it the task wakes only once the encoding is done)."""
    tokenizer = RecordingTokenizer()
    encoder = PromptEncoder()
    text = "".join(chr(97 + (i * 7919) % 26) for i in range(300_000))

    async def encode_and_count() -> tuple[list[int], int]:
        wakes = 0
        encoding = asyncio.ensure_future(encoder.encode(text, tokenizer, len(text)))
        while not encoding.done():
            await asyncio.sleep(0.001)
            wakes += tokenizer.started.is_set() and not encoding.done()
        return encoding.result(), wakes

    ids, wakes_while_encoding = asyncio.run(encode_and_count())
    assert ids == list(text.encode())
    assert wakes_while_encoding >= 3
    encoder.close()
