"""The gateway driven by the official ``openai`` client, sync and async, in
front of a real stack (``pagedkv serve`` on a tiny llama with a Llama-3-style
chat template, one CPU executor): completions and chat, streamed and not,
n > 1, prompt lists, logprobs, seeds, stop strings; greedy output equals
Hugging Face ``generate`` on the same prompt (chat: on the prompt
transformers' ``apply_chat_template`` renders from the same template).

The tiny tokenizer maps byte ``b`` to token ``b``; 256 is <bos>, 257 <eos>.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is first imported

from pagedkv.common.ports import split_address
from pagedkv.executor.tiny_model import make_tiny_model
from tests.executor.test_generation import hf_greedy
from tests.gateway.stack import Gateway, nothing_held, wait_until
from tests.service.stack import Process, serve

PROMPT = "Hello, paged world!"
NEW_TOKENS = 16
MESSAGES = [{"role": "user", "content": "What is paged attention?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gateway") / "llama"
    make_tiny_model(path, "llama", seed=7, chat_template="llama3")
    return path


@pytest.fixture(scope="module")
def stack(model: Path):
    with serve(model, executors=1, num_blocks=256) as process:
        yield process


@pytest.fixture(scope="module")
def gateway(stack: Process, model: Path):
    with Gateway(stack.target, model, ("--served-model-name", "tiny")) as process:
        yield process


@pytest.fixture
def client(gateway: Gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def decode(model: Path, ids: list[int]) -> str:
    return str(Tokenizer.from_file(str(model / "tokenizer.json")).decode(ids))


def hf_chat_prompt(model: Path, messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def test_completion_is_hugging_face_greedy(client, model) -> None:
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    expected = decode(model, hf_greedy(model, list(PROMPT.encode()), NEW_TOKENS))
    (choice,) = completion.choices
    assert choice.text == expected
    assert choice.finish_reason == "length"
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.model == "tiny"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(PROMPT.encode())
    assert completion.usage.completion_tokens == NEW_TOKENS
    assert completion.usage.total_tokens == len(PROMPT.encode()) + NEW_TOKENS


def test_a_token_id_prompt_and_a_stream_give_the_same_text(client, model) -> None:
    whole = client.completions.create(
        model="tiny", prompt=list(PROMPT.encode()), max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert len(chunks) > 2
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    *events, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == NEW_TOKENS
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in events)
    assert len({c.id for c in chunks}) == 1


def test_continuous_usage_counts_the_prompt_and_the_tokens_so_far(gateway) -> None:
    import httpx

    body = {
        "model": "tiny", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body) as response:
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    usages = [json.loads(d)["usage"] for d in data]
    assert all(u["prompt_tokens"] == len(PROMPT) for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-2] == counts[-1] == NEW_TOKENS
    assert "cached_tokens" in usages[-1]["prompt_tokens_details"]  # the scheduler's own


def test_chat_is_hugging_face_greedy_on_the_rendered_template(client, model) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt = hf_chat_prompt(model, MESSAGES)
    expected = decode(model, hf_greedy(model, prompt, NEW_TOKENS))
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason == "length"
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.usage is not None and completion.usage.prompt_tokens == len(prompt)


def test_async_chat_streams_and_runs_concurrently(gateway, model) -> None:
    async def run() -> tuple[list[str], str]:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0
        ) as client:

            async def streamed() -> str:
                stream = await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0,
                    stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                parts, roles = [], []
                async for chunk in stream:
                    for choice in chunk.choices:
                        roles.append(choice.delta.role)
                        parts.append(choice.delta.content or "")
                assert chunk.object == "chat.completion.chunk"
                assert roles[0] == "assistant" and set(roles[1:]) <= {None}
                return "".join(parts)

            texts = await asyncio.gather(*(streamed() for _ in range(4)))
            whole = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return list(texts), whole.choices[0].message.content or ""

    texts, whole = asyncio.run(run())
    assert texts == [whole] * 4


def test_n_and_prompt_lists_number_the_choices_prompt_by_prompt(client, model) -> None:
    prompts = [PROMPT, "KV"]
    completion = client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        expected = decode(model, hf_greedy(model, list(prompt.encode()), 8))
        assert [c.text for c in completion.choices[2 * i : 2 * i + 2]] == [expected] * 2
    assert completion.usage is not None and completion.usage.completion_tokens == 32
    assert completion.usage.prompt_tokens == len(PROMPT) + 2  # once per prompt


def test_seeded_samples_are_reproducible(client) -> None:
    def sample() -> list[str]:
        completion = client.completions.create(
            model="tiny", prompt=PROMPT, n=3, max_tokens=12, temperature=1.0, seed=11,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return [c.text for c in completion.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) >= 2


def test_completion_logprobs_have_one_entry_per_token(client) -> None:
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == 6
    assert logprobs.text_offset == [0, 1, 2, 3, 4, 5]
    for token, chosen, top in zip(
        logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs or [], strict=True
    ):
        assert chosen <= 0
        # the 3 most likely and the chosen one, keyed by text (bytes of one
        # character's pieces all read U+FFFD, so keys may coincide)
        assert 1 <= len(top) <= 4 and top[token] == chosen
        assert max(top.values()) == chosen


def test_chat_logprobs_carry_bytes_and_top_tokens(client, model) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    expected = hf_greedy(model, hf_chat_prompt(model, MESSAGES), 8)
    content = completion.choices[0].logprobs.content
    assert [entry.bytes for entry in content] == [[t] if t < 256 else [] for t in expected]
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob == entry.logprob for entry in content)


def test_stop_strings_end_the_text_before_them(client, model) -> None:
    greedy = decode(model, hf_greedy(model, list(PROMPT.encode()), NEW_TOKENS))
    stop = greedy[3:5]
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stop=[stop, "\x00"],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.text == greedy[: greedy.index(stop)]
    assert choice.finish_reason == "stop"
    kept = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == greedy[: greedy.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens_pass_through(client, model) -> None:
    greedy = hf_greedy(model, list(PROMPT.encode()), NEW_TOKENS)
    stop = greedy[0]
    stopped = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop]},
    )  # fmt: skip
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].finish_reason == "stop"
    later = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop], "min_tokens": 4},
    )  # fmt: skip
    assert later.usage is not None and later.usage.completion_tokens >= 4


def test_models_health_and_metrics(client, gateway) -> None:
    import httpx

    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(f"{gateway.url}/health").status_code == 200
    client.completions.create(model="tiny", prompt="x", max_tokens=2)
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'pagedkv_gateway_requests_total{endpoint="completions",status="200"}' in metrics
    assert "pagedkv_gateway_time_to_first_token_seconds_bucket" in metrics
    assert "pagedkv_gateway_output_tokens_total" in metrics
    assert "pagedkv_gateway_open_streams 0.0" in metrics


def test_a_client_that_goes_away_mid_stream_frees_its_blocks(gateway, stack) -> None:
    import httpx

    body = {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    for _ in range(3):
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
    whole = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection(split_address(gateway.target)) as sock:  # not streamed
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(whole), whole)
        )
    wait_until(lambda: nothing_held(stack.target), 60, "all blocks free")
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'pagedkv_gateway_disconnects_total{endpoint="completions"} 4.0' in metrics
