"""Resuming a broken stream at the Scheduler API (``resumed_token_ids``), on a
real ``pagedkv serve`` stack with one CPU executor on the tiny llama: a
request resumed after its first k tokens continues with exactly the tokens
and text the uninterrupted one had, counts the resumed tokens as outputs, and
leaves nothing held.

The tiny model's tokenizer maps byte ``b`` to token ``b`` (0..255).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from pagedkv.common.text import IncrementalDetokenizer, TextTokenizer
from pagedkv.v1 import common_pb2, scheduler_pb2
from tests.executor.test_generation import hf_greedy, model_dirs
from tests.service.stack import Process, serve
from tests.service.test_stack import assert_nothing_held

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

MAX_MODEL_LEN = 1024  # the tiny model's max_position_embeddings
VOCAB_SIZE = 259  # 256 bytes, <bos>, <eos>, <pad>
PROMPT = list(b"Resume me, please")  # 17 tokens
NUM_TOKENS = 40
FinishReason = scheduler_pb2.FinishReason


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]):
    with serve(model_dirs["llama"], executors=1, num_blocks=128) as process:
        yield process


def request(
    prompt: list[int] | str = PROMPT,
    resumed: Sequence[int] = (),
    max_tokens: int | None = NUM_TOKENS,
    **sampling: object,
) -> scheduler_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(ignore_eos=True, **sampling)  # type: ignore[arg-type]
    if "temperature" not in sampling:
        params.temperature = 0.0
    if max_tokens is not None:
        params.max_tokens = max_tokens
    message = scheduler_pb2.GenerateRequest(sampling=params, resumed_token_ids=resumed)
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.ids.extend(prompt)
    return message


class Stream:
    """What one Generate stream delivered (sequence 0)."""

    def __init__(self, stack: Process, message: scheduler_pb2.GenerateRequest) -> None:
        chunks = list(stack.stub.Generate(message, timeout=300))
        self.tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
        self.text = "".join(o.text_delta for c in chunks for o in c.outputs)
        outputs = [o for c in chunks for o in c.outputs]
        self.finish_reasons = [o.finish_reason for o in outputs if o.finish_reason]
        self.usage = chunks[-1].usage
        assert chunks[-1].HasField("usage")


def delivered_text(model: Path, tokens: list[int]) -> str:
    """The text a stream had delivered with ``tokens``: the deltas of the
    scheduler's detokenizer fed one token at a time (without the flush)."""
    tokenizer = TextTokenizer(Tokenizer.from_file(str(model / "tokenizer.json")))
    detokenizer = IncrementalDetokenizer(tokenizer)
    return "".join(detokenizer.push([token]) for token in tokens)


@pytest.mark.parametrize("k", [1, 15, 16, 39])
def test_a_resumed_greedy_request_continues_as_the_uninterrupted_one(stack, model_dirs, k) -> None:
    full = Stream(stack, request())
    assert full.tokens == hf_greedy(model_dirs["llama"], PROMPT, NUM_TOKENS)
    resumed = Stream(stack, request(resumed=full.tokens[:k]))
    assert resumed.tokens == full.tokens[k:]
    assert resumed.finish_reasons == [FinishReason.FINISH_REASON_LENGTH]
    assert resumed.usage.prompt_tokens == len(PROMPT)
    assert resumed.usage.completion_tokens == NUM_TOKENS
    assert resumed.usage.cached_prompt_tokens <= len(PROMPT)
    assert_nothing_held(stack.stub)


def test_a_resumed_request_reuses_the_cached_blocks_of_its_history(stack) -> None:
    full = Stream(stack, request(max_tokens=48))
    hits = stack.stub.GetStats(scheduler_pb2.GetStatsRequest()).executors[0].prefix_cache_hits
    resumed = Stream(stack, request(resumed=full.tokens[:31], max_tokens=48))  # 48 tokens
    assert resumed.tokens == full.tokens[31:]
    stats = stack.stub.GetStats(scheduler_pb2.GetStatsRequest())
    assert stats.executors[0].prefix_cache_hits - hits >= 32  # 2 of its 3 full blocks
    assert_nothing_held(stack.stub)


def test_a_resumed_seeded_sample_continues_as_the_uninterrupted_one(stack) -> None:
    sampling = {"temperature": 0.9, "seed": 1234}
    full = Stream(stack, request(**sampling))
    assert full.tokens != Stream(stack, request(temperature=0.9, seed=4321)).tokens
    for k in (3, 20):
        resumed = Stream(stack, request(resumed=full.tokens[:k], **sampling))
        assert resumed.tokens == full.tokens[k:]
        assert resumed.usage.completion_tokens == NUM_TOKENS
    assert_nothing_held(stack.stub)


def test_resumed_text_continues_the_delivered_text(stack, model_dirs) -> None:
    model = model_dirs["llama"]
    full = Stream(stack, request("Hello", max_tokens=24))
    assert "\ufffd" in full.text  # byte tokens that are not whole characters
    for k in range(1, 24):
        resumed = Stream(stack, request("Hello", resumed=full.tokens[:k], max_tokens=24))
        assert resumed.tokens == full.tokens[k:]
        assert delivered_text(model, full.tokens[:k]) + resumed.text == full.text, k


def test_a_character_split_by_the_break_is_completed_not_repeated(stack, model_dirs) -> None:
    tokenizer = Tokenizer.from_file(str(model_dirs["llama"] / "tokenizer.json"))
    # "Hé" with the break inside the é (0xC3 0xA9): the caller got "H" and the
    # first byte, whose text the broken stream held back.
    for resumed_ids, delivered in (([0x48, 0xC3], "H"), ([0x48, 0xC3, 0xA9], "Hé")):
        resumed = Stream(stack, request("Hello", resumed=resumed_ids, max_tokens=8))
        assert len(resumed.tokens) == 8 - len(resumed_ids)
        whole = tokenizer.decode(resumed_ids + resumed.tokens, skip_special_tokens=True)
        assert delivered + resumed.text == whole
    assert_nothing_held(stack.stub)


def test_stop_tokens_apply_only_to_new_tokens(stack) -> None:
    full = Stream(stack, request())
    k = 10
    stop = full.tokens[k - 1]  # the last resumed token
    tail = full.tokens[k:]
    end = tail.index(stop) + 1 if stop in tail else len(tail)
    resumed = Stream(stack, request(resumed=full.tokens[:k], stop_token_ids=[stop]))
    assert resumed.tokens == tail[:end]
    assert resumed.usage.completion_tokens == k + end
    assert_nothing_held(stack.stub)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resumed": [1, 2], "n": 2}, "resumed_token_ids: only with n == 1"),
        ({"resumed": [1, 2], "beam_width": 2}, "resumed_token_ids: a beam search"),
        ({"resumed": [1, VOCAB_SIZE]}, r"resumed_token_ids\[1\]: token 259 >= vocab_size"),
        ({"resumed": [7] * NUM_TOKENS}, "resumed_token_ids: 40 tokens already reach"),
        ({"resumed": [7] * 50}, "resumed_token_ids: 50 tokens already reach"),
        (
            {"resumed": [7] * (MAX_MODEL_LEN - len(PROMPT)), "max_tokens": None},
            "resumed_token_ids: 17 prompt tokens .* leave no room in max_model_len",
        ),
    ],
)
def test_bad_resumed_tokens_are_invalid_arguments(stack, kwargs, message) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Generate(request(**kwargs), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details()), info.value.details()
    assert_nothing_held(stack.stub)


def test_the_longest_valid_resume_generates_one_token(stack) -> None:
    resumed = Stream(stack, request(resumed=[7] * (NUM_TOKENS - 1)))
    assert len(resumed.tokens) == 1
    assert resumed.usage.completion_tokens == NUM_TOKENS
    assert_nothing_held(stack.stub)
