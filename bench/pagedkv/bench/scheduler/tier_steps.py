"""The scheduler's CPU for the step that admits a long prompt, by where its
prefix is: nowhere (recompute), in the GPU pool, or in the host tier.

Drives the service's own ``ExecutorScheduler`` (``schedule()`` then
``process()``, answered by ``executor_sim``) over a GPU pool that holds one
prompt and a host tier, in rounds as ``pagedkv.bench.scheduler.host_ttft``
runs them end to end: a new prompt (recomputed; it evicts the previous
round's prompt, which goes to the host), the same prompt again (a GPU hit),
then the previous round's prompt (a host hit: its blocks are loaded, and the
GPU blocks it takes are evicted and offloaded in the same step). Times
``schedule()`` of the step that admits each prompt: the step that the first
token waits for, whose host-hit version carries a load and an offload per
block.

    python -m pagedkv.bench.scheduler.tier_steps [--prompt-len 4096] [--rounds 21]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import time

from pagedkv.bench.scheduler.executor_sim import (
    BLOCK_SIZE,
    VOCAB_SIZE,
    answers,
    apply_answers,
    executor_info,
    generation,
)
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.v1 import common_pb2

TIERS = ("recompute", "gpu_hit", "host_hit")


def measure(
    prompt_len: int, rounds: int, host_blocks: int, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Per tier: the median ``schedule()`` time (ms) of the admitting step over
    ``rounds`` rounds (the first left out), and that step's offloads and loads."""
    num_blocks = prompt_len // BLOCK_SIZE + 4  # one prompt's blocks, as host_ttft sizes it
    info = executor_info(num_blocks, 16, max_num_batched_tokens=prompt_len)
    info.num_host_blocks = host_blocks
    scheduler = ExecutorScheduler(
        "bench",
        info,
        common_pb2.Owner(owner_id="bench", epoch=1),
        max_num_seqs=16,
        max_num_batched_tokens=prompt_len,
    )
    assert scheduler.kv.host is not None
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(prompt_len)] for _ in range(rounds + 1)]
    times: dict[str, list[float]] = {tier: [] for tier in TIERS}
    copies: dict[str, tuple[int, int]] = {}
    clock = time.perf_counter
    key = 0
    gc.collect()
    for r in range(1, rounds + 1):
        for tier, prompt in zip(TIERS, (prompts[r], prompts[r], prompts[r - 1]), strict=True):
            key += 1
            gen = generation(scheduler, key, prompt, 1)
            scheduler.add(gen.sequences[0])
            t0 = clock()
            step = scheduler.schedule()
            elapsed = clock() - t0
            assert step is not None and len(step.num_scheduled) == 1
            request = step.request
            if r > 1:
                times[tier].append(elapsed)
            copies[tier] = (len(request.offload_block_ids), len(request.load_block_ids))
            apply_answers(scheduler, answers(step, key))
            while (step := scheduler.schedule()) is not None:  # the rows freed
                apply_answers(scheduler, answers(step, key))
            while not gen.chunks.empty():
                gen.chunks.get_nowait()
    report = scheduler.kv.check_integrity()
    assert report.ok, report.errors
    return {
        tier: {
            "schedule_ms_median": statistics.median(times[tier]) * 1e3,
            "schedule_ms_best": min(times[tier]) * 1e3,
            "offloads": copies[tier][0],
            "loads": copies[tier][1],
        }
        for tier in TIERS
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=21, help="the first is left out")
    parser.add_argument("--host-blocks", type=int, default=2048)
    args = parser.parse_args(argv)
    result = measure(args.prompt_len, args.rounds, args.host_blocks)
    print(
        f"machine: {platform.platform()}, python {platform.python_version()}, {os.cpu_count()} CPUs"
    )
    print(
        f"the step admitting a {args.prompt_len}-token prompt, {args.rounds - 1} rounds, "
        f"host tier of {args.host_blocks} blocks: schedule() in ms, median (best)"
    )
    for tier, row in result.items():
        print(
            f"{tier}: {row['schedule_ms_median']:.3f} ({row['schedule_ms_best']:.3f}); "
            f"offloads {row['offloads']}, loads {row['loads']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
