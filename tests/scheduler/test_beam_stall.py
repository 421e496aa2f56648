"""Beam searches under block pressure never stall: when every running
sequence is a beam waiting for its round while the preempted beams those
rounds wait for cannot get blocks, the newest such search is preempted
whole, and every request still ends."""

from __future__ import annotations

import random
from functools import partial

import pytest

from pagedkv.bench.scheduler.executor_sim import sampled_rows
from pagedkv.scheduler.beam import BeamSearch
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.sequence import Generation
from pagedkv.v1 import common_pb2, executor_pb2
from tests.scheduler.stepping import add_generation, live_scheduler, run_to_end

NUM_CANDIDATES = 4
BLOCK_SIZE = 16  # executor_info's


def respond(message: executor_pb2.StepRequest, rng: random.Random) -> executor_pb2.StepResponse:
    """Random samples, each with random top candidates."""
    rows = sampled_rows(message)
    n = len(rows)
    return executor_pb2.StepResponse(
        step_id=message.step_id,
        sampled_rows=rows,
        sampled_token_ids=[rng.randrange(50, 90) for _ in rows],
        sampled_logprobs=[-0.1] * n,
        num_top_logprobs=[NUM_CANDIDATES] * n,
        top_token_ids=[rng.randrange(50, 90) for _ in range(NUM_CANDIDATES * n)],
        top_logprobs=[-0.1 * (i + 1) for i in range(NUM_CANDIDATES)] * n,
    )


def workload(scheduler: ExecutorScheduler, rng: random.Random, num_blocks: int) -> list[Generation]:
    """Six generations, mostly beam searches of width 2 to 4, each of which
    fits the pool alone."""
    generations = []
    for key in range(1, 7):
        width = rng.choice([1, 2, 3, 4])
        n = 1 if width > 1 else rng.choice([1, 2])
        prompt = [rng.randrange(3, 40) for _ in range(rng.randrange(4, 40))]
        max_tokens = rng.randrange(4, 30)
        while max(width, n) * -(-(len(prompt) + max_tokens) // BLOCK_SIZE) > num_blocks - 1:
            prompt = prompt[: len(prompt) // 2]
            max_tokens = max(2, max_tokens // 2)
        sampling = common_pb2.SamplingParams(temperature=0.0 if width > 1 else 1.0, n=n)
        beam = None
        if width > 1:
            sampling.beam_width = width
            beam = BeamSearch(width, NUM_CANDIDATES)
        generations.append(
            add_generation(
                scheduler, f"g{key}", prompt, max_tokens, key=key, sampling=sampling, beam=beam
            )
        )
    return generations


@pytest.mark.parametrize("num_blocks", [8, 10, 14])
@pytest.mark.parametrize("depth", [1, 2])
def test_beam_searches_short_of_blocks_all_end(num_blocks: int, depth: int) -> None:
    for seed in range(25):
        rng = random.Random(seed)
        scheduler = live_scheduler(num_blocks)
        generations = workload(scheduler, rng, num_blocks)
        run_to_end(scheduler, generations, partial(respond, rng=rng), depth)
        assert scheduler.kv.check_integrity().ok, seed
        assert scheduler.kv.pool.get_num_free_blocks() == num_blocks - 1, seed
