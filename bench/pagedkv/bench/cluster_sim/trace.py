"""The simulation's traffic: shared document prefixes, unique suffixes, Poisson arrivals.

Every prompt is one of ``num_prefixes`` shared prefixes (system prompts or
documents, lengths uniform in ``[min_prefix_len, max_prefix_len]``), chosen
with a Zipf popularity (prefix ``k`` of rank 1.. drawn in proportion to
``1 / k**zipf_s``), followed by a user suffix of random tokens with a
lognormal length; outputs have lognormal lengths too. Arrivals are Poisson
at ``rate`` requests per second for ``duration_s`` seconds. The same config
gives the same requests, so every policy sees the same trace.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceConfig:
    rate: float = 1024.0  # requests per second, whole cluster
    duration_s: float = 30.0
    num_prefixes: int = 48
    min_prefix_len: int = 512
    max_prefix_len: int = 2048
    zipf_s: float = 1.0
    mean_suffix_len: float = 192.0
    mean_output_len: float = 160.0
    sigma: float = 0.8  # of the lognormal lengths
    max_suffix_len: int = 2048
    max_output_len: int = 1024
    vocab_size: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.duration_s > 0:
            raise ValueError("rate and duration_s must be positive")
        if not 0 < self.min_prefix_len <= self.max_prefix_len:
            raise ValueError("prefix lengths: 0 < min_prefix_len <= max_prefix_len")
        if self.num_prefixes < 1:
            raise ValueError("num_prefixes must be at least 1")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One arrival: its prompt (shared prefix + unique suffix) and output length."""

    request_id: str
    arrival_s: float
    prefix_id: int
    prefix_len: int
    prompt_token_ids: list[int]
    num_output_tokens: int


def lognormal_len(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    """A length with a lognormal distribution of mean ``mean``, in ``[1, cap]``."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def build_prefixes(config: TraceConfig) -> list[list[int]]:
    """The shared prefixes, most popular first."""
    rng = random.Random(f"prefixes-{config.seed}")
    vocab = range(config.vocab_size)
    return [
        rng.choices(vocab, k=rng.randint(config.min_prefix_len, config.max_prefix_len))
        for _ in range(config.num_prefixes)
    ]


def generate(config: TraceConfig) -> Iterator[TraceRequest]:
    """The arrivals in time order, made as they are asked for."""
    prefixes = build_prefixes(config)
    popularity = list(
        itertools.accumulate(1.0 / (k + 1) ** config.zipf_s for k in range(len(prefixes)))
    )
    rng = random.Random(f"arrivals-{config.seed}")
    vocab = range(config.vocab_size)
    ids = range(len(prefixes))
    now = 0.0
    for i in itertools.count():
        now += rng.expovariate(config.rate)
        if now >= config.duration_s:
            return
        (prefix_id,) = rng.choices(ids, cum_weights=popularity)
        suffix_len = lognormal_len(rng, config.mean_suffix_len, config.sigma, config.max_suffix_len)
        prompt = prefixes[prefix_id] + rng.choices(vocab, k=suffix_len)
        num_output = lognormal_len(rng, config.mean_output_len, config.sigma, config.max_output_len)
        prefix_len = len(prefixes[prefix_id])
        yield TraceRequest(f"req-{i}", now, prefix_id, prefix_len, prompt, num_output)
