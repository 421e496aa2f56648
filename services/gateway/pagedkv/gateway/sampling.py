"""OpenAI request parameters onto the v1 contract: one ``GenerateRequest``
per prompt, each with the request's ``n`` inside.

The mapping (docs/http.md has the table): ``max_tokens`` (chat:
``max_completion_tokens``) -> ``sampling.max_tokens``, ``temperature``,
``top_p``, ``top_k`` (-1 and 0: off), ``seed`` (a negative seed is taken
modulo 2**64), ``n``, ``stop`` -> ``sampling.stop``, ``stop_token_ids``,
``ignore_eos``, ``min_tokens``, ``include_stop_str_in_output``, and
``logprobs`` (completions: the number of top tokens; chat: ``top_logprobs``
when ``logprobs`` is true) -> ``sampling.logprobs``. A text prompt goes as
``prompt.text`` (the scheduler tokenizes it and adds no special tokens);
token ids as ``prompt.token_ids``. Values are range-checked by the
scheduler, which names the field (mapped back to the parameter).
"""

from __future__ import annotations

from pagedkv.gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pagedkv.v1 import common_pb2, scheduler_pb2

_SEED_MODULUS = 2**64


def sampling_params(
    request: SamplingFields, *, max_tokens: int | None, logprobs: int | None
) -> common_pb2.SamplingParams:
    """The SamplingParams of ``request`` (unset fields stay unset: the
    scheduler's defaults apply)."""
    sampling = common_pb2.SamplingParams(
        n=request.n,
        top_k=max(request.top_k or 0, 0),
        stop_token_ids=request.stop_token_ids or (),
        ignore_eos=request.ignore_eos,
        stop=request.stop_strings(),
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,
    )
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.seed is not None:
        sampling.seed = request.seed % _SEED_MODULUS
    if logprobs is not None:
        sampling.logprobs = logprobs
    return sampling


def completion_requests(
    request: CompletionRequest, request_id: str
) -> list[scheduler_pb2.GenerateRequest]:
    """One GenerateRequest per prompt, ids ``<request_id>-<prompt index>``."""
    sampling = sampling_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs)
    out = []
    for i, prompt in enumerate(request.prompts()):
        generate = scheduler_pb2.GenerateRequest(request_id=f"{request_id}-{i}", sampling=sampling)
        if isinstance(prompt, str):
            generate.text = prompt
        else:
            generate.token_ids.ids.extend(prompt)
        out.append(generate)
    return out


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    """``sampling.logprobs`` of a chat request: None without ``logprobs``."""
    if not request.logprobs:
        return None
    return request.top_logprobs or 0


def chat_generate_request(
    request: ChatCompletionRequest, prompt: str, request_id: str
) -> scheduler_pb2.GenerateRequest:
    """The GenerateRequest of a chat request whose messages rendered to ``prompt``."""
    sampling = sampling_params(
        request, max_tokens=request.output_limit(), logprobs=chat_logprobs(request)
    )
    return scheduler_pb2.GenerateRequest(request_id=request_id, sampling=sampling, text=prompt)
