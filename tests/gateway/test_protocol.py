"""The gateway's request mapping and error policy, without processes: OpenAI
parameters onto the v1 contract, pydantic errors and gRPC statuses as
OpenAI errors, and token strings for logprobs."""

from __future__ import annotations

import json

import grpc
import pydantic
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pagedkv.client.errors import error_from_rpc
from pagedkv.gateway.errors import ApiError, from_pagedkv, from_validation, scheduler_param
from pagedkv.gateway.logprobs import TokenStrings
from pagedkv.gateway.protocol import ChatCompletionRequest, CompletionRequest, check_supported
from pagedkv.gateway.sampling import chat_generate_request, completion_requests


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"model": "m", **fields}))


def test_parameters_map_onto_sampling_params() -> None:
    request = completion(
        prompt="Hi", max_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, seed=-1, n=2,
        stop="\n", stop_token_ids=[3], ignore_eos=True, min_tokens=2, logprobs=0,
        include_stop_str_in_output=True,
    )  # fmt: skip
    (generate,) = completion_requests(request, "cmpl-x")
    sampling = generate.sampling
    assert generate.request_id == "cmpl-x-0" and generate.text == "Hi"
    assert (sampling.max_tokens, sampling.n, sampling.top_k) == (7, 2, 0)
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert sampling.seed == 2**64 - 1
    assert list(sampling.stop) == ["\n"] and list(sampling.stop_token_ids) == [3]
    assert sampling.ignore_eos and sampling.include_stop_str_in_output
    assert sampling.min_tokens == 2
    assert sampling.HasField("logprobs") and sampling.logprobs == 0


def test_unset_parameters_stay_unset() -> None:
    (generate,) = completion_requests(completion(prompt=[1, 2, 3]), "cmpl-x")
    sampling = generate.sampling
    assert list(generate.token_ids.ids) == [1, 2, 3]
    for field in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        assert not sampling.HasField(field), field


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompts_of_every_form_give_one_stream_each(prompt, expected) -> None:
    assert completion(prompt=prompt).prompts() == expected
    requests = completion_requests(completion(prompt=prompt), "r")
    assert [r.request_id for r in requests] == [f"r-{i}" for i in range(len(expected))]


def test_chat_takes_max_completion_tokens_over_max_tokens_and_top_logprobs() -> None:
    request = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9,
                "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3,
            }
        )
    )  # fmt: skip
    generate = chat_generate_request(request, "PROMPT", "chatcmpl-x")
    assert generate.text == "PROMPT" and generate.sampling.max_tokens == 4
    assert generate.sampling.logprobs == 3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": "a", "presence_penalty": 0.1}, "presence_penalty"),
        ({"prompt": "a", "repetition_penalty": 1.1}, "repetition_penalty"),
        ({"prompt": "a", "min_p": 0.05}, "min_p"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_values_that_cannot_be_honoured_are_refused_naming_them(fields, param) -> None:
    with pytest.raises(ApiError) as refused:
        check_supported(completion(**fields))
    assert refused.value.status == 400 and refused.value.param == param


def test_neutral_values_pass() -> None:
    check_supported(
        completion(
            prompt="a", presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0,
            logit_bias={}, min_p=0, best_of=1, echo=False, user="u", seed=3,
        )
    )  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ('{"model": "m", "prompt": "a", "n": "2"}', "n", "invalid_value"),
        ('{"model": "m", "prompt": "a", "n": 1.5}', "n", "invalid_value"),
        ('{"model": "m", "prompt": "a", "stream": 1}', "stream", "invalid_value"),
        ('{"model": "m"}', "prompt", "missing_required_parameter"),
        ('{"model": "m", "prompt": "a", "foo": 1}', "foo", "unsupported_parameter"),
        ('{"model": "m", "prompt": [1, "a"]}', "prompt", "invalid_value"),
        ("[1]", None, "invalid_json"),
        ("{", None, "invalid_json"),
    ],
)
def test_validation_errors_name_the_parameter(body, param, code) -> None:
    with pytest.raises(pydantic.ValidationError) as failed:
        CompletionRequest.model_validate_json(body)
    error = from_validation(failed.value)
    assert (error.status, error.param, error.code) == (400, param, code)


@pytest.mark.parametrize(
    ("details", "param"),
    [
        ("sampling.top_p: 2 is not in (0, 1]", "top_p"),
        ("sampling.stop[3]: longer than 256 characters", "stop"),
        ("sampling.max_tokens: 5 prompt tokens + 5000 > max_model_len 1024", "max_tokens"),
        ("prompt.token_ids.ids[4]: token 9999 >= vocab_size 259", "prompt"),
        ("prompt: 2000 tokens leave no room in max_model_len 1024", "prompt"),
        ("request_id: too long", None),
    ],
)
def test_scheduler_fields_become_openai_parameters(details, param) -> None:
    assert scheduler_param(details) == param


def test_chat_names_the_prompt_messages_and_the_logprobs_top_logprobs() -> None:
    assert scheduler_param("prompt: too long", "messages") == "messages"
    assert scheduler_param("sampling.logprobs: 30 > max_logprobs 20", "messages") == "top_logprobs"
    assert scheduler_param("sampling.top_p: 2", "messages") == "top_p"


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "status", "retry_after"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, 1),
        (grpc.StatusCode.UNAVAILABLE, 503, 1),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
        (grpc.StatusCode.UNAUTHENTICATED, 502, None),
        (grpc.StatusCode.PERMISSION_DENIED, 502, None),
        (grpc.StatusCode.INTERNAL, 500, None),
        (grpc.StatusCode.ALREADY_EXISTS, 500, None),
    ],
)
def test_grpc_statuses_become_http_statuses(code, status, retry_after) -> None:
    error = from_pagedkv(error_from_rpc(_RpcError(code, "sampling.n: too many")))
    assert (error.status, error.retry_after) == (status, retry_after)
    response = error.response()
    assert response.status_code == status
    assert set(json.loads(bytes(response.body))["error"]) == {"message", "type", "param", "code"}
    assert ("retry-after" in response.headers) == (retry_after is not None)


def test_token_strings_of_a_byte_level_tokenizer_give_exact_bytes() -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    strings = TokenStrings(tokenizer)
    ids = tokenizer.encode("é!").ids
    assert [strings.get(i)[1] for i in ids] == [b"\xc3", b"\xa9", b"!"]
    assert [strings.get(i)[0] for i in ids] == ["\ufffd", "\ufffd", "!"]
    assert strings.num_tokens("é!") == 3


def test_token_strings_of_sentencepiece_pieces() -> None:
    vocab = {"<unk>": 0, "\u2581Hi": 1, "<0xE2>": 2, "there": 3}
    strings = TokenStrings(Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")))
    assert strings.get(1) == (" Hi", b" Hi")
    assert strings.get(2) == ("\ufffd", b"\xe2")
    assert strings.get(3) == ("there", b"there")


def test_chat_template_kwargs_may_set_add_generation_prompt(tmp_path) -> None:
    from pagedkv.gateway.chat import render
    from pagedkv.gateway.chat_template import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ m.content }};{% endfor %}"
                            "{% if add_generation_prompt %}>{% endif %}{{ extra }}")  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]

    def chat(**fields: object) -> ChatCompletionRequest:
        body = {"model": "m", "messages": messages, **fields}
        return ChatCompletionRequest.model_validate_json(json.dumps(body))

    assert render(template, chat()) == "hi;>"
    assert render(template, chat(add_generation_prompt=False)) == "hi;"
    kwargs = {"add_generation_prompt": False, "extra": "!"}
    assert render(template, chat(chat_template_kwargs=kwargs)) == "hi;!"
    with pytest.raises(ApiError) as refused:
        render(None, chat())
    assert refused.value.param == "messages"
