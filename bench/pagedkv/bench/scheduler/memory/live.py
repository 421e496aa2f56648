"""The live stack a memory scenario runs on, and the blocks it holds.

``tiny_model`` writes a random tiny llama whose ``max_model_len`` is
``max_model_len`` (``make-tiny-model``, then more rotary positions: the
weights do not depend on them). ``memory_stack`` starts ``pagedkv serve`` (one
CPU executor, 16-token blocks) as a child process, through the serving
benchmark's ``ServeStack``. ``BlockSampler`` polls the
scheduler's ``GetStats`` while a workload runs: blocks held are the usable
blocks minus the free ones (cached blocks with no holder count as free).
Each poll also reads the executor's peak since the previous one and starts
it over, so the peak is exact however briefly it lasts: a short run can
fall between two polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.bench.scheduler.serving.stack import ServeStack
from pagedkv.client import AsyncClient

BLOCK_SIZE = 16  # the executor's default, and the scenarios'


def tiny_model(path: Path, max_model_len: int) -> str:
    """A tiny random llama in ``path`` with ``max_model_len`` positions."""
    command = [sys.executable, "-m", "pagedkv.common.cli", "make-tiny-model", str(path)]
    subprocess.run([*command, "--arch", "llama"], check=True, stdout=subprocess.DEVNULL)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max_model_len
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return str(path)


def memory_stack(
    model: str, num_blocks: int, max_num_seqs: int, kv_cache_dtype: str = "auto"
) -> ServeStack:
    """``pagedkv serve`` on one CPU executor of ``num_blocks`` blocks of
    ``kv_cache_dtype``, single decode steps (a decode window holds its slots
    ahead of its tokens, which the blocks-held samples would count against
    the paging)."""
    options = ["--device", "cpu", "--num-blocks", str(num_blocks)]
    options += ["--kv-cache-dtype", kv_cache_dtype]
    options += ["--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", "8192"]
    options += ["--decode-window", "1"]
    return ServeStack(model, [*options, "--executor-timeout", "600"])


@dataclass
class Samples:
    """What the sampler read: seconds from its start, blocks held, running
    and waiting requests, and the tokens the client counts as held."""

    times_s: list[float] = field(default_factory=list)
    blocks_held: list[int] = field(default_factory=list)
    num_running: list[int] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    tokens_held: list[int] = field(default_factory=list)
    num_started: list[int] = field(default_factory=list)
    # The most blocks held at once since the previous sample (the pool's own
    # count, not a poll's): the peak between samples.
    peak_blocks_held: list[int] = field(default_factory=list)

    def peak_blocks(self) -> int:
        return max(self.blocks_held + self.peak_blocks_held, default=0)

    def time_weighted_mean(self, values: list[int], busy_only: bool = True) -> float:
        """Mean of ``values`` over time (each sample holds until the next),
        over the samples where blocks are held when ``busy_only``."""
        total = weight = 0.0
        for i in range(len(self.times_s) - 1):
            if busy_only and self.blocks_held[i] == 0:
                continue
            dt = self.times_s[i + 1] - self.times_s[i]
            total += values[i] * dt
            weight += dt
        return total / weight if weight else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "times_s": [round(t, 3) for t in self.times_s],
            "blocks_held": self.blocks_held,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "tokens_held": self.tokens_held,
            "num_started": self.num_started,
            "peak_blocks_held": self.peak_blocks_held,
        }


class BlockSampler:
    """Polls ``GetStats`` every ``interval_s`` until stopped; ``tokens`` gives
    the tokens the client knows to be held at that moment and the number of
    requests whose first tokens came (their prompts are computed)."""

    def __init__(
        self, client: AsyncClient, interval_s: float, tokens: Callable[[], tuple[int, int]]
    ) -> None:
        self.client, self.interval_s, self.tokens = client, interval_s, tokens
        self.samples = Samples()
        self.integrity_ok = True
        self._stop = asyncio.Event()

    async def run(self) -> None:
        await self.client.stats(timeout=30, reset_peak_used_blocks=True)  # peaks from now
        start = time.perf_counter()
        while True:
            stats = await self.client.stats(timeout=30, reset_peak_used_blocks=True)
            tokens, started = self.tokens()
            executor = stats.executors[0]
            s = self.samples
            s.times_s.append(time.perf_counter() - start)
            s.blocks_held.append(executor.num_usable_blocks - executor.num_free_blocks)
            s.peak_blocks_held.append(executor.peak_used_blocks)
            s.num_running.append(stats.num_running)
            s.num_waiting.append(stats.num_waiting)
            s.tokens_held.append(tokens)
            s.num_started.append(started)
            self.integrity_ok &= stats.integrity.ok
            if self._stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)

    def stop(self) -> None:
        self._stop.set()
