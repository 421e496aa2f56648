"""``GenerateRequest.skip_text`` on a real ``pagedkv serve`` stack (one CPU
executor, the tiny llama): a request that asks for token ids only gets the
tokens a normal one gets and no text, through the raw API and the SDK, and a
normal request still gets its text.

The tiny model's tokenizer maps byte ``b`` to token ``b`` (0..255).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.client import Client
from pagedkv.v1 import common_pb2, scheduler_pb2
from tests.executor.test_generation import model_dirs
from tests.service.fuzz_checks import text_of
from tests.service.stack import Process, serve
from tests.service.test_stack import assert_nothing_held, collect

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

PROMPT = "Only the tokens, please"
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]):
    with serve(model_dirs["llama"], executors=1, num_blocks=128) as process:
        yield process


def request(skip_text: bool, **sampling: object) -> scheduler_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    return scheduler_pb2.GenerateRequest(text=PROMPT, sampling=params, skip_text=skip_text)


def texts(chunks: list[scheduler_pb2.GenerateResponse]) -> dict[int, str]:
    joined: dict[int, str] = {}
    for chunk in chunks:
        for output in chunk.outputs:
            joined[output.index] = joined.get(output.index, "") + output.text_delta
    return joined


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11, "n": 2}],
    ids=["greedy", "seeded-n2"],
)
def test_skip_text_gets_the_same_tokens_and_no_text(
    stack: Process, sampling: dict[str, object]
) -> None:
    tokens, chunks = collect(stack.stub, request(False, **sampling))
    skipped_tokens, skipped_chunks = collect(stack.stub, request(True, **sampling))
    assert skipped_tokens == tokens
    assert all(len(ids) == NUM_TOKENS for ids in tokens.values())
    assert set(texts(skipped_chunks).values()) == {""}
    assert texts(chunks) == {i: text_of(ids) for i, ids in tokens.items()}
    assert any(texts(chunks).values())  # the normal request's text is not empty
    usage, skipped_usage = chunks[-1].usage, skipped_chunks[-1].usage
    assert skipped_usage.prompt_tokens == usage.prompt_tokens
    assert skipped_usage.completion_tokens == usage.completion_tokens
    assert_nothing_held(stack.stub)


def test_skip_text_beams_have_their_tokens_and_no_text(stack: Process) -> None:
    (*_, final) = stack.stub.Generate(request(False, beam_width=2), timeout=300)
    (*_, skipped) = stack.stub.Generate(request(True, beam_width=2), timeout=300)
    assert [list(b.token_ids) for b in skipped.beams] == [list(b.token_ids) for b in final.beams]
    assert [b.text for b in final.beams] == [text_of(list(b.token_ids)) for b in final.beams]
    assert {b.text for b in skipped.beams} == {""}
    assert_nothing_held(stack.stub)


def test_the_sdk_sends_skip_text(stack: Process) -> None:
    with Client(stack.target) as client:
        normal = client.generate_text(PROMPT, max_tokens=NUM_TOKENS, temperature=0.0)
        skipped = client.generate_text(
            PROMPT, max_tokens=NUM_TOKENS, temperature=0.0, skip_text=True
        )
    assert skipped.token_ids == normal.token_ids
    assert normal.text == text_of(list(normal.token_ids[0]))
    assert skipped.text == ""
