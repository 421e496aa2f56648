"""Chat through ``pagedkv serve --http-port`` on a tiny qwen2 with a
Qwen2-style template (the Llama-3-style one is in test_openai_client): the
greedy reply equals Hugging Face ``generate`` on the prompt transformers'
``apply_chat_template`` renders from the same directory, streamed or not."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is first imported

from pagedkv.executor.tiny_model import make_tiny_model
from tests.executor.test_generation import hf_greedy
from tests.gateway.stack import ServeWithGateway
from tests.gateway.test_openai_client import decode, hf_chat_prompt

NEW_TOKENS = 12
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain? ünïcödé"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat-models") / "qwen2"
    make_tiny_model(path, "qwen2", seed=7, chat_template="qwen2")
    return path


@pytest.fixture(scope="module")
def client(model: Path):
    with (
        ServeWithGateway(model, extra=("--served-model-name", "qwen")) as stack,
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0) as client,
    ):
        yield client


@pytest.mark.parametrize("messages", [CONVERSATION[1:2], CONVERSATION], ids=["one", "turns"])
def test_qwen2_chat_is_hugging_face_greedy(client, model, messages) -> None:
    expected = decode(model, hf_greedy(model, hf_chat_prompt(model, messages), NEW_TOKENS))
    whole = client.chat.completions.create(
        model="qwen", messages=messages, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert whole.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model="qwen", messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
