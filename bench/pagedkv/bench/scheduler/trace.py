"""A synthetic ShareGPT-like trace: lognormal lengths and shared system prompts."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: its prompt and how many tokens it generates."""

    request_id: str
    prompt_token_ids: list[int]
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class TraceConfig:
    num_requests: int = 10_000
    mean_prompt_len: float = 250.0
    mean_output_len: float = 200.0
    sigma: float = 1.0
    max_len: int = 4096
    system_prompt_fraction: float = 0.3
    num_system_prompts: int = 10
    system_prompt_len: int = 512
    vocab_size: int = 32_000
    seed: int = 0


def _lognormal_len(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean is `mean`
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def build_trace(config: TraceConfig) -> list[TraceRequest]:
    """The trace: ``system_prompt_fraction`` of the prompts start with one of the
    shared system prompts, followed by a lognormal user part; the whole prompt
    and the output are capped at ``max_len`` tokens."""
    rng = random.Random(config.seed)
    vocab = range(config.vocab_size)
    system_prompts = [
        rng.choices(vocab, k=config.system_prompt_len) for _ in range(config.num_system_prompts)
    ]
    trace = []
    for i in range(config.num_requests):
        user_len = _lognormal_len(rng, config.mean_prompt_len, config.sigma, config.max_len)
        prompt = rng.choices(vocab, k=user_len)
        if rng.random() < config.system_prompt_fraction:
            prompt = (rng.choice(system_prompts) + prompt)[: config.max_len]
        output_len = _lognormal_len(rng, config.mean_output_len, config.sigma, config.max_len)
        trace.append(TraceRequest(f"req-{i}", prompt, output_len))
    return trace
