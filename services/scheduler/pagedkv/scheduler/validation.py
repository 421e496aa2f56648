"""Checks of a Generate call against the model the executors serve: the
prompt, the sampling params and the tokens of a resumed stream. Errors name
the field (``InvalidArgument``)."""

from __future__ import annotations

import math
from typing import NamedTuple

from pagedkv.common.errors import InvalidArgument
from pagedkv.scheduler.beam import BeamSearch
from pagedkv.scheduler.stop_strings import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from pagedkv.v1 import common_pb2, executor_pb2, scheduler_pb2

MAX_N = 64


class ValidSampling(NamedTuple):
    """What the scheduler applies itself: samples, the token limit, beams."""

    n: int
    max_tokens: int
    beam: BeamSearch | None


def prompt_token_ids(
    request: scheduler_pb2.GenerateRequest, text_ids: list[int] | None, vocab_size: int
) -> list[int]:
    """The prompt's token ids: ``text_ids`` for a text prompt (its encoding,
    made beforehand off the event loop; None: the model has no tokenizer),
    else the request's ids."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidArgument("prompt: set text or token_ids")
    if which == "text":
        if text_ids is None:
            raise InvalidArgument("prompt.text: the model has no tokenizer; send token_ids")
        prompt = text_ids
    else:
        prompt = list(request.token_ids.ids)
    if not prompt:
        raise InvalidArgument(f"prompt.{which}: the prompt is empty")
    if max(prompt) >= vocab_size:  # in C: millions of ids take milliseconds
        i, token = next((i, t) for i, t in enumerate(prompt) if t >= vocab_size)
        raise InvalidArgument(
            f"prompt.token_ids.ids[{i}]: token {token} >= vocab_size {vocab_size}"
        )
    return prompt


def validate_sampling(
    sampling: common_pb2.SamplingParams, prompt_len: int, info: executor_pb2.GetInfoResponse
) -> ValidSampling:
    """Checks every field against the model's limits (``info``)."""
    if sampling.HasField("max_tokens") and sampling.max_tokens == 0:
        raise InvalidArgument("sampling.max_tokens: must be at least 1")
    room = info.max_model_len - prompt_len
    if room <= 0:
        raise InvalidArgument(
            f"prompt: {prompt_len} tokens leave no room in max_model_len {info.max_model_len}"
        )
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else room
    if max_tokens > room:
        raise InvalidArgument(
            f"sampling.max_tokens: {prompt_len} prompt tokens + {max_tokens} > "
            f"max_model_len {info.max_model_len}"
        )
    if sampling.HasField("temperature") and not (
        math.isfinite(sampling.temperature) and sampling.temperature >= 0
    ):
        raise InvalidArgument(f"sampling.temperature: {sampling.temperature} is not >= 0")
    if sampling.HasField("top_p") and not 0 < sampling.top_p <= 1:
        raise InvalidArgument(f"sampling.top_p: {sampling.top_p} is not in (0, 1]")
    if sampling.top_k > info.vocab_size:
        raise InvalidArgument(f"sampling.top_k: {sampling.top_k} > vocab_size {info.vocab_size}")
    if sampling.HasField("logprobs") and sampling.logprobs > info.max_logprobs:
        raise InvalidArgument(
            f"sampling.logprobs: {sampling.logprobs} > max_logprobs {info.max_logprobs}"
        )
    for i, token in enumerate(sampling.stop_token_ids):
        if token >= info.vocab_size:
            raise InvalidArgument(
                f"sampling.stop_token_ids[{i}]: token {token} >= vocab_size {info.vocab_size}"
            )
    _check_stop_strings(sampling)
    if sampling.min_tokens > max_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens: {sampling.min_tokens} > max_tokens {max_tokens}"
        )
    n = sampling.n or 1
    beam = None
    if sampling.beam_width > 1:
        if n > 1:
            raise InvalidArgument("sampling.n: must be 1 with beam search")
        if sampling.beam_width > info.max_logprobs:
            raise InvalidArgument(
                f"sampling.beam_width: {sampling.beam_width} > {info.max_logprobs} "
                "(the executors' max_logprobs)"
            )
        if sampling.stop:
            raise InvalidArgument("sampling.stop: not supported with beam search")
        if sampling.min_tokens:
            raise InvalidArgument("sampling.min_tokens: not supported with beam search")
        width = sampling.beam_width
        beam = BeamSearch(width, min(2 * width, info.max_logprobs))
    if n > MAX_N:
        raise InvalidArgument(f"sampling.n: {n} > {MAX_N}")
    return ValidSampling(n, max_tokens, beam)


def _check_stop_strings(sampling: common_pb2.SamplingParams) -> None:
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            f"sampling.stop: {len(sampling.stop)} stop strings > {MAX_STOP_STRINGS}"
        )
    for i, stop in enumerate(sampling.stop):
        if not stop:
            raise InvalidArgument(f"sampling.stop[{i}]: empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(
                f"sampling.stop[{i}]: {len(stop)} characters > {MAX_STOP_STRING_CHARS}"
            )


def resumed_token_ids(
    request: scheduler_pb2.GenerateRequest,
    valid: ValidSampling,
    prompt_len: int,
    info: executor_pb2.GetInfoResponse,
) -> list[int]:
    """The output tokens a resumed stream already delivered (empty: a new
    request), checked against the validated sampling: only one sequence
    without beams, every id in the vocabulary, and room left for at least one
    new token under max_tokens and max_model_len."""
    resumed = list(request.resumed_token_ids)
    if not resumed:
        return resumed
    if valid.beam is not None:
        raise InvalidArgument("resumed_token_ids: a beam search cannot be resumed")
    if valid.n > 1:
        raise InvalidArgument(f"resumed_token_ids: only with n == 1 (n is {valid.n})")
    for i, token in enumerate(resumed):
        if token >= info.vocab_size:
            raise InvalidArgument(
                f"resumed_token_ids[{i}]: token {token} >= vocab_size {info.vocab_size}"
            )
    if prompt_len + len(resumed) >= info.max_model_len:
        raise InvalidArgument(
            f"resumed_token_ids: {prompt_len} prompt tokens + {len(resumed)} resumed "
            f"leave no room in max_model_len {info.max_model_len}"
        )
    if len(resumed) >= valid.max_tokens:
        raise InvalidArgument(
            f"resumed_token_ids: {len(resumed)} tokens already reach "
            f"sampling.max_tokens {valid.max_tokens}"
        )
    return resumed
