"""Errors in OpenAI's shape with the right status, from ``pagedkv serve
--http-port`` (the embedded stack's gateway) and gateways in front of it:
400 naming the parameter (validation, unsupported parameters, a prompt the
scheduler refuses), 404 for an unknown model or route, 401 for a missing or
wrong bearer token, 400 for chat on a model without a template, 503 while no
target serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from tests.gateway.stack import Gateway, ServeWithGateway, free_port

MODEL = "tiny"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    make_tiny_model(root / "llama", "llama", seed=7)
    make_tiny_model(root / "bare", "llama", seed=7, chat_template="none")
    return {"llama": root / "llama", "bare": root / "bare"}


@pytest.fixture(scope="module")
def stack(models: dict[str, Path]):
    with ServeWithGateway(models["llama"], extra=("--served-model-name", MODEL)) as process:
        yield process


def post(url: str, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=60, **kwargs)


def assert_error(
    response: httpx.Response, status: int, param: str | None, words: str = ""
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    return dict(error)


def test_the_embedded_gateway_serves_and_names_its_model(stack) -> None:
    assert any("gateway ready on" in line for line in stack.lines)
    models = httpx.get(f"{stack.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{stack.url}/health").status_code == 200
    done = post(
        stack.url,
        "completions",
        {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
    )
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "Hi", "temperature": "hot"}, "temperature", "number"),
        ({"prompt": "Hi", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "Hi", "max_tokens": True}, "max_tokens", ""),
        ({"prompt": "Hi", "top_p": 1.5}, "top_p", ""),
        ({"prompt": "Hi", "stop": 3}, "stop", ""),
        ({"prompt": [], "max_tokens": 3}, "prompt", "empty"),
        ({}, "prompt", "required"),
        ({"prompt": "Hi", "colour": "blue"}, "colour", "unknown"),
        ({"prompt": "Hi", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"prompt": "Hi", "frequency_penalty": 1}, "frequency_penalty", "not supported"),
        ({"prompt": "Hi", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        ({"prompt": "Hi", "best_of": 3}, "best_of", ""),
        ({"prompt": "Hi", "echo": True}, "echo", "not supported"),
        ({"prompt": "Hi", "suffix": "end"}, "suffix", "not supported"),
        ({"prompt": "Hi", "min_p": 0.1}, "min_p", "not supported"),
        ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options", ""),
        ({"prompt": "Hi", "max_tokens": 5000}, "max_tokens", "max_model_len"),
        ({"prompt": "x" * 1100}, "prompt", "max_model_len"),
        ({"prompt": "Hi", "logprobs": 1000}, "logprobs", ""),
        ({"prompt": [[1, 2], [5000]]}, "prompt", "vocab_size"),
    ],
)
def test_bad_completion_parameters_are_400_naming_them(stack, body, param, words) -> None:
    assert_error(post(stack.url, "completions", {"model": MODEL, **body}), 400, param, words)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "robot", "content": "beep"}]}, None),
    ],
)
def test_bad_chat_parameters_are_400_naming_them(stack, body, param) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}
    error = assert_error(post(stack.url, "chat/completions", request), 400, param or "messages")
    assert error["type"] == "invalid_request_error"


def test_an_unknown_model_or_route_is_404(stack) -> None:
    error = assert_error(
        post(stack.url, "completions", {"model": "gpt-4", "prompt": "Hi"}), 404, "model"
    )
    assert error["code"] == "model_not_found"
    assert httpx.get(f"{stack.url}/v1/nothing").status_code == 404
    assert "error" in httpx.get(f"{stack.url}/v1/nothing").json()


def test_another_method_on_a_generation_route_is_405(stack) -> None:
    for path in ("completions", "chat/completions"):
        answer = httpx.get(f"{stack.url}/v1/{path}")
        assert answer.status_code == 405 and answer.headers["allow"] == "POST"
        assert "use POST" in answer.json()["error"]["message"]


def test_the_openai_client_raises_its_own_error_types(stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hi", presence_penalty=1.0)
    assert bad.value.param == "presence_penalty"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi")
    with pytest.raises(openai.BadRequestError):  # after the stream was asked for
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5000, stream=True)


def test_bearer_tokens_are_required_when_configured(stack, models, tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# callers\nsecret-one\nsecret-two\n")
    scheduler = stack.target
    extra = ("--served-model-name", MODEL, "--auth-token-file", str(tokens))
    with Gateway(scheduler, models["llama"], extra) as gateway:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        assert_error(post(gateway.url, "completions", body), 401, None, "no bearer token")
        wrong = {"Authorization": "Bearer secret-three"}
        assert_error(post(gateway.url, "completions", body, headers=wrong), 401, None)
        assert httpx.get(f"{gateway.url}/v1/models", headers=wrong).status_code == 401
        for token in ("secret-one", "secret-two"):
            right = {"Authorization": f"Bearer {token}"}
            assert post(gateway.url, "completions", body, headers=right).status_code == 200
        assert httpx.get(f"{gateway.url}/health").status_code == 200  # open


def test_chat_without_a_template_is_400(stack, models) -> None:
    with Gateway(stack.target, models["bare"], ("--served-model-name", MODEL)) as gateway:
        request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        response = post(gateway.url, "chat/completions", request)
        assert_error(response, 400, "messages", "no chat template")
        completion = post(gateway.url, "completions", {"model": MODEL, "prompt": "Hi"})
        assert completion.status_code == 200


def test_without_a_serving_target_health_is_503_and_requests_too(models) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    with Gateway(nowhere, models["llama"], ("--served-model-name", MODEL)) as gateway:
        assert httpx.get(f"{gateway.url}/health").status_code == 503
        response = post(gateway.url, "completions", {"model": MODEL, "prompt": "Hi"})
        assert_error(response, 503, None, "no server at")
        assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--http-port", "-1"], "--http-port -1: a port"),
        (["--served-model-name", "x"], "--served-model-name needs --http-port"),
        (["--http-port", "0", "--tls-cert", "c", "--tls-key", "k"], "--scheduler-tls-ca"),
    ],
)
def test_serve_refuses_wrong_gateway_options_in_one_line(args, words, capsys) -> None:
    from pagedkv.common.cli import main

    assert main(["serve", *args]) == 2
    assert words in capsys.readouterr().err


def test_gateway_refuses_a_model_that_is_not_there(capsys, tmp_path) -> None:
    from pagedkv.common.cli import main

    missing = str(tmp_path / "missing")
    assert main(["gateway", "--target", "127.0.0.1:1", "--model", missing, "--port", "0"]) == 2
    assert f"--model {missing}: no such directory" in capsys.readouterr().err
