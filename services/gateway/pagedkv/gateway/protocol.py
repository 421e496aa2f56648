"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``.

Pydantic models in strict mode (no coercion: ``"1"`` is not a number, ``1``
is not a boolean) that forbid unknown fields, so a parameter the gateway does
not know is refused with a 400 naming it rather than silently ignored.
Parameters OpenAI defines that the gateway cannot honour yet are accepted
only at their neutral value (``presence_penalty: 0``, ``echo: false``,
``logit_bias: {}`` ...); ``check_supported`` refuses any other value,
naming the parameter. docs/http.md lists them all.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv.gateway.errors import ApiError, unsupported


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    """A last event with ``choices: []`` and the request's usage."""
    continuous_usage_stats: bool = False
    """vLLM's usage so far on every event."""


class ResponseFormat(_Body):
    type: str
    json_schema: dict[str, Any] | None = None


class SamplingFields(_Body):
    """What both endpoints take: the model, sampling and the common extras."""

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # The common extras (vLLM's names).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Accepted at their neutral value only (check_supported).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


Prompt = Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right")]
"""Text, token ids, or a batch of either. Tried in this order, the first
that fits wins (strict: no coercion, so at most one fits): a prompt of token
ids is validated once, not by every member as "smart" unions do."""


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (one stream each)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]  # one prompt of token ids
        return list(prompt)  # type: ignore[arg-type]  # a batch


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; fields beyond these go to the template as given."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as plain data, for the chat template (which joins text parts)."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted at their neutral value only (check_supported).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None

    def output_limit(self) -> int | None:
        """``max_completion_tokens``, else the older ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def _refuse_unless(condition: bool, param: str, why: str = "not supported") -> None:
    if not condition:
        raise unsupported(param, why)


def check_supported(request: SamplingFields) -> None:
    """Refuses (ApiError 400 naming the parameter) every parameter given a
    value the gateway cannot honour; the neutral values pass."""
    _refuse_unless(not request.presence_penalty, "presence_penalty", "not supported (only 0)")
    _refuse_unless(not request.frequency_penalty, "frequency_penalty", "not supported (only 0)")
    _refuse_unless(
        request.repetition_penalty in (None, 1.0), "repetition_penalty", "not supported (only 1)"
    )
    _refuse_unless(not request.logit_bias, "logit_bias")
    _refuse_unless(not request.min_p, "min_p", "not supported: the sampler has no min_p (only 0)")
    _refuse_unless(request.skip_special_tokens, "skip_special_tokens", "only true is supported")
    _refuse_unless(
        request.service_tier in (None, "auto", "default"), "service_tier", "only auto or default"
    )
    options = request.stream_options
    if options is not None:
        _refuse_unless(request.stream, "stream_options", "only with stream: true")
    if isinstance(request, CompletionRequest):
        _refuse_unless(not request.echo, "echo")
        _refuse_unless(not request.suffix, "suffix")
        _refuse_unless(request.best_of in (None, request.n), "best_of", "only equal to n")
        if isinstance(request.prompt, list) and not request.prompt:
            raise ApiError(400, "prompt: empty", param="prompt", code="invalid_value")
    if isinstance(request, ChatCompletionRequest):
        _refuse_unless(not request.tools, "tools")
        _refuse_unless(request.tool_choice in (None, "none"), "tool_choice", "only none")
        _refuse_unless(not request.parallel_tool_calls, "parallel_tool_calls")
        _refuse_unless(not request.functions, "functions")
        _refuse_unless(request.function_call in (None, "none"), "function_call", "only none")
        if request.response_format is not None:
            _refuse_unless(
                request.response_format.type == "text", "response_format", "only type text"
            )
        _refuse_unless(request.modalities in (None, ["text"]), "modalities", "only [text]")
        if request.top_logprobs is not None:
            _refuse_unless(request.logprobs, "top_logprobs", "needs logprobs: true")
