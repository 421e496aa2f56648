"""The options of a Generate request, declared once: ``GenerateOptions``.

``GenerateOptions`` is a ``TypedDict`` that every method taking them
spells ``**options: Unpack[GenerateOptions]`` (``Client.generate``,
``AsyncClient.generate``, their ``generate_text`` and ``generate_request``),
and that ``pagedkv generate`` fills from its flags. A TypedDict rather than
a frozen dataclass, because it keeps the call sites as they are:
``client.generate("hi", max_tokens=8, stop=["x"])`` stays a plain keyword
call that mypy checks name by name and type by type, where a dataclass
would make every caller build an options object first. Adding an option is
one line here and one in ``generate_request``; every method, its type check
and the CLI's mapping follow.

Defaults are not part of a TypedDict: each lives once, where
``generate_request`` reads the option into the proto (docs/sdk.md's table
lists them). An option left out, or None where the type allows it, takes
that default; an optional sampling field left as None stays unset in the
proto, so that the scheduler applies its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

from pagedkv.v1 import common_pb2, scheduler_pb2

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only for the type checker

_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of a Generate request besides ``prompt``, each
    optional (docs/sdk.md, "Generate's arguments", says what each does)."""

    token_ids: Sequence[int] | None  # the prompt as token ids, instead of ``prompt``
    max_tokens: int | None  # None: the scheduler's (up to max_model_len)
    temperature: float | None  # None: the scheduler's (1.0); 0 is greedy
    top_p: float | None  # None: the scheduler's (1.0)
    top_k: int  # 0: off
    seed: int | None  # None: not reproducible
    n: int  # 1: one sample
    beam_width: int  # 0: off; >= 2: beam search
    stop_token_ids: Sequence[int]  # (): none
    ignore_eos: bool  # False
    stop: str | Sequence[str]  # stop strings (one string is one); (): none
    include_stop_str_in_output: bool  # False: the text ends before the stop string
    min_tokens: int  # 0
    logprobs: int | None  # None: none
    cache_salt: str  # "": shares prefix-cache blocks with every other unsalted request
    priority: int  # 0; lower is more important
    request_id: str  # "": a uuid4 hex, given when the stream starts
    skip_text: bool  # False; True: token ids only, no text


OPTION_NAMES = frozenset(GenerateOptions.__annotations__)
"""Every option's name, for code that maps other names onto them (the CLI)."""


def _check_uint(name: str, value: int, limit: int = _UINT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ValueError(f"{name}: must be an integer in [0, {limit}], got {value!r}")
    return value


def generate_request(
    prompt: str | None = None, **options: Unpack[GenerateOptions]
) -> scheduler_pb2.GenerateRequest:
    """The GenerateRequest for ``prompt`` and ``options`` (see ``Client.generate``).

    Raises TypeError for a keyword that is not an option (as a misspelt
    keyword argument does), and ValueError, naming the option, unless
    exactly one of ``prompt`` and ``token_ids`` is given or when an id or
    count is not a non-negative integer; every other check (ranges,
    vocabulary, lengths) is the scheduler's, answered with INVALID_ARGUMENT.
    """
    unknown = sorted(options.keys() - OPTION_NAMES)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    token_ids = options.get("token_ids")
    if (prompt is None) == (token_ids is None):
        raise ValueError("prompt: exactly one of prompt and token_ids must be given")
    stop = options.get("stop", ())
    sampling = common_pb2.SamplingParams(
        top_k=_check_uint("top_k", options.get("top_k", 0)),
        n=_check_uint("n", options.get("n", 1)),
        beam_width=_check_uint("beam_width", options.get("beam_width", 0)),
        stop_token_ids=[
            _check_uint(f"stop_token_ids[{i}]", t)
            for i, t in enumerate(options.get("stop_token_ids", ()))
        ],
        ignore_eos=options.get("ignore_eos", False),
        stop=[stop] if isinstance(stop, str) else stop,
        include_stop_str_in_output=options.get("include_stop_str_in_output", False),
        min_tokens=_check_uint("min_tokens", options.get("min_tokens", 0)),
    )
    if (max_tokens := options.get("max_tokens")) is not None:
        sampling.max_tokens = _check_uint("max_tokens", max_tokens)
    if (temperature := options.get("temperature")) is not None:
        sampling.temperature = temperature
    if (top_p := options.get("top_p")) is not None:
        sampling.top_p = top_p
    if (seed := options.get("seed")) is not None:
        sampling.seed = _check_uint("seed", seed, _UINT64_MAX)
    if (logprobs := options.get("logprobs")) is not None:
        sampling.logprobs = _check_uint("logprobs", logprobs)
    request = scheduler_pb2.GenerateRequest(
        request_id=options.get("request_id", ""),
        sampling=sampling,
        cache_salt=options.get("cache_salt", ""),
        priority=options.get("priority", 0),
        skip_text=options.get("skip_text", False),
    )
    if prompt is not None:
        request.text = prompt
    else:
        assert token_ids is not None
        ids = [_check_uint(f"token_ids[{i}]", t) for i, t in enumerate(token_ids)]
        request.token_ids.CopyFrom(scheduler_pb2.TokenIds(ids=ids))
    return request
