"""The routing benchmark's trace: shared prefixes, unique suffixes, mixed lengths.

Token ids throughout, so no tokenizer is involved. Each request is one of
``num_prefixes`` prefixes of ``prefix_len`` tokens, drawn with Zipf
popularity (``zipf`` 0: uniform), followed by a suffix of its own whose
length is log-uniform in ``[min_suffix_len, max_suffix_len]``, and asks for
one of ``output_lens`` new tokens (greedy, EOS ignored). The same config
gives the same requests, in the same order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceConfig:
    vocab_size: int
    num_requests: int = 256
    num_prefixes: int = 16
    prefix_len: int = 512
    min_suffix_len: int = 8
    max_suffix_len: int = 128
    output_lens: tuple[int, ...] = (8, 16, 32, 64)
    zipf: float = 1.0  # prefix i (from 0) is drawn with weight 1 / (i + 1) ** zipf
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_suffix_len <= self.max_suffix_len:
            raise ValueError("suffix lengths: need 1 <= min <= max")
        if self.num_prefixes < 1 or self.prefix_len < 1 or not self.output_lens:
            raise ValueError("need at least one prefix of one token and one output length")
        if self.zipf < 0:
            raise ValueError(f"zipf: {self.zipf} must be >= 0")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    prefix_index: int
    token_ids: tuple[int, ...]  # the prefix, then the suffix
    suffix_len: int
    max_tokens: int


def prefix_weights(config: TraceConfig) -> list[float]:
    """Each prefix's share of the requests, most popular first (sums to 1)."""
    raw = [1.0 / (i + 1) ** config.zipf for i in range(config.num_prefixes)]
    total = sum(raw)
    return [w / total for w in raw]


def generate(config: TraceConfig) -> list[TraceRequest]:
    """The trace's requests in sending order."""
    rng = random.Random(config.seed)
    vocab = config.vocab_size
    prefixes = [
        tuple(rng.randrange(vocab) for _ in range(config.prefix_len))
        for _ in range(config.num_prefixes)
    ]
    weights = prefix_weights(config)
    low, high = math.log(config.min_suffix_len), math.log(config.max_suffix_len + 1)
    requests = []
    for i in range(config.num_requests):
        prefix = rng.choices(range(config.num_prefixes), weights)[0]
        suffix_len = min(config.max_suffix_len, int(math.exp(rng.uniform(low, high))))
        suffix = tuple(rng.randrange(vocab) for _ in range(suffix_len))
        requests.append(
            TraceRequest(
                request_id=f"routing-{i:05d}",
                prefix_index=prefix,
                token_ids=prefixes[prefix] + suffix,
                suffix_len=suffix_len,
                max_tokens=rng.choice(config.output_lens),
            )
        )
    return requests
