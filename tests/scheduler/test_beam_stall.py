"""Beam searches under block pressure never stall: when every running
sequence is a beam waiting for its round while the preempted beams those
rounds wait for cannot get blocks, the newest such search is preempted
whole, and every request still ends."""

from __future__ import annotations

import random
from collections import deque

import pytest

from pagedkv.scheduler.beam import BeamSearch
from pagedkv.scheduler.bench.steps import executor_info, sampled_rows
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.sequence import Generation, Sequence
from pagedkv.v1 import common_pb2, executor_pb2

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
        if width > 1:
            sampling.beam_width = width
        gen = Generation(
            request_id=f"g{key}",
            prompt_token_ids=prompt,
            sampling=sampling,
            max_tokens=max_tokens,
            n=n,
            priority=0,
            cache_salt="",
            eos_token_ids=frozenset(),
            stop_token_ids=frozenset(),
            beam=BeamSearch(width, NUM_CANDIDATES) if width > 1 else None,
            key=key,
        )
        request = scheduler.kv.make_request(gen.new_seq_id(), prompt, max_tokens=max_tokens)
        gen.sequences.append(Sequence(gen, 0, request))
        scheduler.add(gen.sequences[0])
        generations.append(gen)
    return generations


@pytest.mark.parametrize("num_blocks", [8, 10, 14])
@pytest.mark.parametrize("depth", [1, 2])
def test_beam_searches_short_of_blocks_all_end(num_blocks: int, depth: int) -> None:
    for seed in range(25):
        rng = random.Random(seed)
        scheduler = ExecutorScheduler(
            "executor",
            executor_info(num_blocks=num_blocks, max_num_rows=16),
            common_pb2.Owner(owner_id="test", epoch=1),
            max_num_seqs=16,
            max_num_batched_tokens=256,
        )
        generations = workload(scheduler, rng, num_blocks)
        inflight: deque[ScheduledStep] = deque()
        for _ in range(400):
            if all(g.done for g in generations):
                break
            step = scheduler.schedule()
            if step is not None:
                inflight.append(step)
            assert inflight, f"seed {seed}: nothing to step, {len(scheduler.waiting)} waiting"
            if step is None or len(inflight) >= depth:
                sent = inflight.popleft()
                processed = scheduler.process(sent, respond(sent.request, rng))
                assert not processed.errors, processed.errors
                for gen in processed.touched:
                    gen.flush()
        assert all(g.done for g in generations), f"seed {seed}: unfinished after 400 steps"
        assert scheduler.kv.check_integrity().ok
        assert scheduler.kv.pool.get_num_free_blocks() == num_blocks - 1
