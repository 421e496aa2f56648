"""What the serving benchmark sends: a seeded ShareGPT-like mix at Poisson
arrival times, and a fixed batch sent all at once.

The mix is the block benchmark's trace (``pagedkv.bench.scheduler.trace``:
lognormal prompt and output lengths, a share of the prompts behind one of a
few shared system prompts) with each request clipped so that its prompt and
output fit the model's context: a request never asks for more tokens than
the server may give, so every request is expected to finish with exactly
``max_tokens`` tokens (``ignore_eos``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pagedkv.bench.scheduler.trace import TraceConfig, build_trace


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: its prompt and exactly how many tokens it must generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class MixConfig:
    """The ShareGPT-like mix (means of the lognormal lengths, before clipping)."""

    num_requests: int
    max_model_len: int
    vocab_size: int
    mean_prompt_len: float = 220.0
    mean_output_len: float = 190.0
    sigma: float = 1.0
    system_prompt_fraction: float = 0.3
    num_system_prompts: int = 4
    system_prompt_len: int = 128
    seed: int = 0


def sharegpt_like(config: MixConfig, prefix: str = "mix") -> list[BenchRequest]:
    """``config.num_requests`` requests; prompt + output <= ``max_model_len``
    (the output is shortened first, the prompt only when it alone leaves no
    room for one token)."""
    assert config.max_model_len >= 2
    trace = build_trace(
        TraceConfig(
            num_requests=config.num_requests,
            mean_prompt_len=config.mean_prompt_len,
            mean_output_len=config.mean_output_len,
            sigma=config.sigma,
            max_len=config.max_model_len,
            system_prompt_fraction=config.system_prompt_fraction,
            num_system_prompts=config.num_system_prompts,
            system_prompt_len=min(config.system_prompt_len, config.max_model_len // 2),
            vocab_size=config.vocab_size,
            seed=config.seed,
        )
    )
    requests = []
    for i, entry in enumerate(trace):
        prompt = entry.prompt_token_ids[: config.max_model_len - 1]
        max_tokens = min(entry.num_output_tokens, config.max_model_len - len(prompt))
        requests.append(BenchRequest(f"{prefix}-{i}", tuple(prompt), max_tokens))
    return requests


def fixed_batch(
    num_requests: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """``num_requests`` random prompts of ``prompt_len`` tokens, each to
    generate ``max_tokens`` (no shared prefix: the batch measures decoding)."""
    rng = random.Random(seed)
    vocab = range(vocab_size)
    return [
        BenchRequest(f"batch-{i}", tuple(rng.choices(vocab, k=prompt_len)), max_tokens)
        for i in range(num_requests)
    ]


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: exponential gaps of mean
    ``1 / rate``, the first request at 0; all at 0 when ``rate`` is inf."""
    if math.isinf(rate):
        return [0.0] * num_requests
    assert rate > 0
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def parse_rates(text: str) -> list[float]:
    """``"2,4,inf"`` -> ``[2.0, 4.0, inf]``, ``""`` -> none; ValueError on a
    rate <= 0."""
    rates = [float(part) for part in text.split(",") if part.strip()]
    if any(not rate > 0 for rate in rates):
        raise ValueError(f"rates must be positive numbers or inf: {text!r}")
    return rates
