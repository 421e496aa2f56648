"""The client SDK and its commands against the real stack: ``pagedkv serve``
(one CPU executor on the tiny llama) driven through ``Client``,
``AsyncClient`` and ``pagedkv generate``/``stats``, checked against Hugging
Face greedy decoding and the tokenizer.

The tiny model's tokenizer maps byte ``b`` to token ``b`` (0..255); 256 is
<bos>, 257 <eos>, 258 <pad>, and decoding skips those three.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pagedkv.client import (
    AsyncClient,
    Client,
    Completion,
    FinishReason,
    InvalidArgumentError,
    UnavailableError,
    Usage,
)
from pagedkv.common.cli import main
from tests.executor.test_generation import hf_greedy, model_dirs
from tests.service.stack import Process, serve

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

BLOCK_SIZE = 16  # the executors' default --block-size
MAX_MODEL_LEN = 1024  # the tiny model's max_position_embeddings
EOS_TOKEN_ID = 257
HELLO = list(b"Hello")


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]):
    with serve(model_dirs["llama"], executors=1, num_blocks=128) as process:
        yield process


@pytest.fixture(scope="module")
def model(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture
def client(stack: Process):
    with Client(stack.target, timeout=120) as client:
        yield client


def tokenizer_text(model: Path, ids: tuple[int, ...] | list[int]) -> str:
    """What the tokenizer decodes ``ids`` to (special tokens skipped)."""
    return Tokenizer.from_file(str(model / "tokenizer.json")).decode(
        list(ids), skip_special_tokens=True
    )


def assert_text_matches_tokens(model: Path, completion: Completion) -> None:
    """Each sequence's streamed text is the decode of its tokens: the bytes
    of the byte tokens, invalid UTF-8 replaced by U+FFFD."""
    for text, ids in zip(completion.texts, completion.token_ids, strict=True):
        assert text == tokenizer_text(model, ids)
        assert text == bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def assert_nothing_held(client: Client) -> None:
    stats = client.stats()
    assert stats.integrity.ok, stats.integrity.message
    assert stats.num_running == stats.num_waiting == 0
    (executor,) = stats.executors
    assert executor.num_free_blocks == executor.num_blocks - 1
    assert executor.kv_cache_usage == 0.0


def test_generate_text_is_hugging_face_greedy_and_its_decoded_bytes(client, model) -> None:
    completion = client.generate_text(prompt="Hello", max_tokens=16, temperature=0, ignore_eos=True)
    assert list(completion.token_ids[0]) == hf_greedy(model, HELLO, 16)
    assert completion.finish_reasons == (FinishReason.LENGTH,)
    assert completion.usage == Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=16)
    assert_text_matches_tokens(model, completion)
    assert "\ufffd" in completion.text  # this continuation has invalid UTF-8 in it
    assert_nothing_held(client)


def test_generate_streams_chunks_and_ends_with_usage(client, model) -> None:
    chunks = list(client.generate("Hello", max_tokens=16, temperature=0, ignore_eos=True))
    assert len(chunks) > 1
    assert [chunk.is_final for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks[0].sequences[0].token_ids) < 16
    tokens = [t for chunk in chunks for seq in chunk.sequences for t in seq.token_ids]
    assert tokens == hf_greedy(model, HELLO, 16)
    assert chunks[-1].usage == Usage(5, 0, 16)
    assert len({chunk.request_id for chunk in chunks}) == 1


def test_seeded_samples_are_reproducible_and_differ_from_each_other(client, model) -> None:
    def sample() -> Completion:
        return client.generate_text(
            "Hello", n=3, temperature=0.9, seed=5, max_tokens=16, ignore_eos=True
        )

    first, second = sample(), sample()
    assert len(first.texts) == 3
    assert all(len(ids) == 16 for ids in first.token_ids)
    assert first.usage.completion_tokens == 48
    assert first.finish_reasons == (FinishReason.LENGTH,) * 3
    assert second.token_ids == first.token_ids
    assert second.texts == first.texts
    assert len(set(first.token_ids)) >= 2
    assert_text_matches_tokens(model, first)


def test_a_stop_token_ends_the_output_at_it(client, model) -> None:
    greedy = hf_greedy(model, HELLO, 16)
    stop = greedy[4]
    end = greedy.index(stop) + 1  # its first occurrence; included in the output
    chunks = list(
        client.generate(
            "Hello", max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop]
        )
    )
    completion = Completion.from_chunks(chunks)
    assert list(completion.token_ids[0]) == greedy[:end]
    assert completion.finish_reasons == (FinishReason.STOP,)
    (last,) = [seq for chunk in chunks for seq in chunk.sequences if seq.finish_reason]
    assert last.stop_token_id == stop
    assert completion.usage.completion_tokens == end


@pytest.mark.parametrize("kwargs", [{"max_tokens": 1}, {"max_tokens": 8, "stop_token_ids": [121]}])
def test_parallel_samples_that_finish_on_their_first_token_all_end(client, model, kwargs) -> None:
    assert hf_greedy(model, HELLO, 1) == [121]
    completion = client.generate_text(
        "Hello", n=3, temperature=0, ignore_eos=True, timeout=5, **kwargs
    )
    assert completion.token_ids == ((121,),) * 3


def test_eos_ends_the_output_unless_ignored(client, model) -> None:
    # A prompt whose greedy continuation reaches <eos> early (the model is
    # random but fixed by its seed).
    prompt, greedy = next(
        (list(p), g)
        for p in (b"z", b"#", b"Hi", b"Hello")
        if EOS_TOKEN_ID in (g := hf_greedy(model, list(p), 64))
    )
    end = greedy.index(EOS_TOKEN_ID) + 1
    stopped = client.generate_text(token_ids=prompt, max_tokens=64, temperature=0)
    assert list(stopped.token_ids[0]) == greedy[:end]
    assert stopped.finish_reasons == (FinishReason.EOS,)
    assert stopped.text == tokenizer_text(model, greedy[: end - 1])  # <eos> has no text
    ignored = client.generate_text(
        token_ids=prompt, max_tokens=end + 3, temperature=0, ignore_eos=True
    )
    assert list(ignored.token_ids[0]) == greedy[: end + 3]
    assert ignored.finish_reasons == (FinishReason.LENGTH,)


def test_async_client_runs_concurrent_calls_and_aborts_mid_stream(stack, model) -> None:
    prompts = [list(f"async {i}: ".encode()) + HELLO for i in range(8)]

    async def run() -> tuple[list[Completion], bool, list[FinishReason | None]]:
        async with AsyncClient(stack.target, timeout=120) as client:
            completions = await asyncio.gather(
                *(
                    client.generate_text(token_ids=p, max_tokens=12, temperature=0, ignore_eos=True)
                    for p in prompts
                )
            )
            stream = client.generate(
                "Hello", max_tokens=500, temperature=0, ignore_eos=True, request_id="abort-me"
            )
            async with contextlib.aclosing(stream) as chunks:
                first = await anext(chunks)
                assert first.request_id == "abort-me" and not first.is_final
                aborted = await client.abort("abort-me")
                rest = [chunk async for chunk in chunks]
            assert rest[-1].is_final
            reasons = [seq.finish_reason for chunk in rest for seq in chunk.sequences]
            assert not await client.abort("abort-me")  # no longer live
            return list(completions), aborted, reasons

    completions, aborted, reasons = asyncio.run(run())
    for prompt, completion in zip(prompts, completions, strict=True):
        assert list(completion.token_ids[0]) == hf_greedy(model, prompt, 12)
        assert completion.finish_reasons == (FinishReason.LENGTH,)
    assert aborted
    assert reasons[-1] == FinishReason.ABORT
    with Client(stack.target, timeout=60) as client:
        assert_nothing_held(client)


def test_bad_arguments_raise_typed_errors(client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.generate_text("Hello", max_tokens=4, top_p=1.5)
    assert info.value.details.startswith("sampling.top_p"), info.value.details
    with pytest.raises(InvalidArgumentError) as info:
        client.generate_text("x" * (MAX_MODEL_LEN + 10), max_tokens=4)
    assert info.value.details.startswith("prompt"), info.value.details
    with pytest.raises(InvalidArgumentError) as info:
        client.generate_text(token_ids=[1] * MAX_MODEL_LEN, max_tokens=1)
    assert str(MAX_MODEL_LEN) in info.value.details
    with Client("127.0.0.1:1", timeout=10) as nowhere, pytest.raises(UnavailableError):
        nowhere.generate_text("Hello", max_tokens=4)


def test_generate_command_prints_json_lines_of_the_greedy_tokens(
    stack, model, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--target", stack.target, "--prompt", "Hi", "--max-tokens", "5"]
    assert main([*args, "--json", "--temperature", "0"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokens = [t for line in lines for seq in line["sequences"] for t in seq["token_ids"]]
    assert tokens == hf_greedy(model, list(b"Hi"), 5)
    assert lines[-1]["usage"] == {
        "prompt_tokens": 2,
        "cached_prompt_tokens": 0,
        "completion_tokens": 5,
    }
    assert ["usage" in line for line in lines] == [False] * (len(lines) - 1) + [True]


def test_stats_command_shows_the_executor(stack, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", stack.target, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    (executor,) = stats["executors"]
    assert executor["healthy"] is True
    assert executor["num_blocks"] == 128
    assert executor["address"].startswith("127.0.0.1:")
    assert stats["integrity"] == {"ok": True, "message": ""}


@pytest.mark.parametrize("num_tokens", [64, 65])
def test_a_repeated_prompt_reuses_its_whole_blocks_but_the_last_token(
    client, num_tokens: int
) -> None:
    """Only whole blocks within the first num_tokens - 1 tokens come from the
    cache: 63 tokens hold 3 whole blocks (48 tokens), 64 tokens 4 (64)."""
    prompt = list(f"prefix cache, {num_tokens} tokens: ".encode())
    prompt += [(7 * i) % 256 for i in range(num_tokens - len(prompt))]
    expected = (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected == {64: 48, 65: 64}[num_tokens]

    def run() -> Usage:
        return client.generate_text(
            token_ids=prompt, max_tokens=4, temperature=0, ignore_eos=True
        ).usage

    before = client.stats().executors[0]
    assert run() == Usage(num_tokens, 0, 4)
    assert run() == Usage(num_tokens, expected, 4)
    after = client.stats().executors[0]
    assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * num_tokens
    assert after.prefix_cache_hits - before.prefix_cache_hits == expected
    assert_nothing_held(client)


def test_demo_command_runs_its_workload_and_ends_with_nothing_held(
    stack, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["demo", "--target", stack.target, "--requests", "4", "--max-tokens", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # The four samples share the prompt's whole blocks, each adding only its
    # tail (measured while they run: about one + 3, not 4 * one).
    one, four = map(int, re.findall(r"1 sample held (\d+) blocks and 4 samples held (\d+)", out)[0])
    assert one < four < 2 * one
    assert "running 0, waiting 0, preemptions 0, integrity ok; 0 blocks held" in out
