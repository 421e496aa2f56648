"""What a host-tier hit costs against recomputing it, measured on this
executor once it has warmed up (GetInfo reports it; the scheduler's host
tier chooses load or recompute per request from it, docs/memory.md).

- ``prefill_seconds_per_token``: a one-entry forward of ``PREFILL_TOKENS``
  tokens (or the largest power of two the step limits allow: a length the
  warm-up built), the better of two, per token;
- ``load_seconds`` and ``load_seconds_per_block``: loads of one block and of
  ``LOAD_BLOCKS`` blocks from the host tier (the better of two each): a
  fixed cost per load, and what each block adds (when the larger load did
  not take longer, its whole time over its blocks, so a block never costs
  nothing).

Every time is taken with the device idle before and after (synchronized on
CUDA), over scratch blocks and rows that hold nothing yet (offloads of them
first, which build the offloads' kernels before ready).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple, Protocol

import numpy as np
import torch

from pagedkv.executor.block_store import BlockStore
from pagedkv.executor.warm_up import WarmUpRunner, WarmUpStep, run_forwards

PREFILL_TOKENS = 512
LOAD_BLOCKS = 256  # 32 were too few: on the H200 their cost drowned in the fixed one's noise


class HostCosts(NamedTuple):
    """Seconds: a prefill token, a load's fixed cost, a loaded block's."""

    prefill_seconds_per_token: float
    load_seconds: float
    load_seconds_per_block: float


class CostRunner(WarmUpRunner, Protocol):
    """What the measurement needs of the model runner."""

    @property
    def host_kv(self) -> BlockStore | None: ...


def measure_host_costs(runner: CostRunner, num_blocks: int) -> HostCosts | None:
    """The executor's costs (None without a host tier or a scratch block)."""
    store = runner.host_kv
    if store is None or num_blocks < 2:
        return None
    device = runner.device

    def timed(work: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(2):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            work()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return best

    # A power of two, as the warm-up's forwards are: nothing new is built.
    longest = min(PREFILL_TOKENS, runner.config.max_num_batched_tokens, runner.spec.max_model_len)
    length = 1 << (longest.bit_length() - 1)
    step = (WarmUpStep(1, 0, length),)
    prefill = timed(lambda: run_forwards(runner, step, num_blocks)) / length
    count = max(1, min(LOAD_BLOCKS, store.num_blocks, num_blocks - 1))
    block_ids = np.arange(1, 1 + count, dtype=np.int64)
    host_ids = np.arange(count, dtype=np.int64)

    def load(count: int) -> None:
        store.load(host_ids[:count], block_ids[:count])
        store.finish_loads()

    # The offloads' kernels are built here too, before ready: the first
    # offload while serving compiled them (on the H200, twice, 50-1,000 ms
    # each, every step behind them waiting).
    for n in (1, count):
        timed(partial(store.offload, block_ids[:n], host_ids[:n]))
    one = timed(lambda: load(1))
    many = timed(lambda: load(count))
    return HostCosts(prefill, *split_load_cost(one, many, count))


def split_load_cost(one: float, many: float, count: int) -> tuple[float, float]:
    """A load's fixed cost and a block's, from the times of a load of one
    block and of ``count``. When the larger load took no longer (the
    blocks' cost drowned in the fixed one's noise: a few small blocks, a
    busy host), all of its time is counted per block, so a block never
    costs nothing."""
    per_block = (many - one) / (count - 1) if count > 1 else one
    if per_block <= 0:
        per_block = many / count
    return max(0.0, one - per_block), per_block
