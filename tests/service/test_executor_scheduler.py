"""``ExecutorScheduler`` step by step against a real executor process: exact
block counts of parallel sampling, preemption by recompute, and release."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from pagedkv.scheduler.executor_client import ExecutorClient
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.sequence import Generation, Sequence
from pagedkv.scheduler.step_message import ScheduledStep
from pagedkv.v1 import common_pb2, executor_pb2
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import hf_greedy, model_dirs

__all__ = ["model_dirs"]

PROMPT = list(b"forty tokens of prompt, shared by all...")  # 40 tokens: 2 full blocks + 8


def generation(scheduler: ExecutorScheduler, request_id: str, n: int, salt: str = "") -> Generation:
    sampling = common_pb2.SamplingParams(temperature=0.0, n=n)
    gen = Generation(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=sampling,
        max_tokens=6,
        n=n,
        priority=0,
        cache_salt=salt,
        eos_token_ids=frozenset(),
        stop_token_ids=frozenset(),
    )
    for index in range(n):
        request = scheduler.kv.make_request(
            f"{request_id}/{index}", PROMPT, cache_salt=salt or None
        )
        gen.sequences.append(Sequence(gen, index, request))
    return gen


async def run_steps(scheduler: ExecutorScheduler, client: ExecutorClient, count: int) -> None:
    for _ in range(count):
        step = scheduler.schedule()
        assert step is not None
        scheduler.process(step, await client.step(step.request))


class Sent(NamedTuple):
    """A step message, and the steps in flight when it was sent (before it)."""

    request: executor_pb2.StepRequest
    in_flight: list[executor_pb2.StepRequest]


async def run_in_flight(
    scheduler: ExecutorScheduler,
    client: ExecutorClient,
    finished: Callable[[], bool],
    depth: int = 2,
) -> list[Sent]:
    """Steps until ``finished()`` with ``depth`` steps in flight, as the
    service keeps them (async stepping), and applies every response; returns
    the messages sent, in order."""
    sent = []
    inflight: list[ScheduledStep] = []
    while not finished():
        while len(inflight) < depth:
            step = scheduler.schedule()
            if step is None:
                break
            sent.append(Sent(step.request, [s.request for s in inflight]))
            await client.send(step.request)
            inflight.append(step)
        scheduler.process(inflight.pop(0), await client.receive())
    for step in inflight:  # those scheduled past the end
        scheduler.process(step, await client.receive())
    return sent


def blocks_held(scheduler: ExecutorScheduler) -> int:
    pool = scheduler.kv.pool
    return pool.num_blocks - 1 - pool.get_num_free_blocks()


def test_four_samples_hold_fewer_blocks_than_four_requests(model_dirs: dict[str, Path]) -> None:
    async def main(executor: ExecutorProcess) -> tuple[int, int, list[list[int]]]:
        client = ExecutorClient(executor.target, "test")
        info = await client.connect()
        scheduler = ExecutorScheduler(
            executor.target, info, client.owner, max_num_seqs=16, max_num_batched_tokens=512
        )
        shared = generation(scheduler, "n4", 4)
        scheduler.add(shared.sequences[0])
        await run_steps(scheduler, client, 2)  # the prefill, then a decode per sequence
        # Two full prompt blocks shared by all four, and each sequence's own
        # copy of the partly filled third block.
        forked = blocks_held(scheduler)
        await run_steps(scheduler, client, 5)
        outputs = [list(s.request.token_ids[len(PROMPT) :]) for s in shared.sequences]
        assert all(s.finished for s in shared.sequences)
        assert blocks_held(scheduler) == 0
        separate = [generation(scheduler, f"r{i}", 1, salt=f"tenant{i}") for i in range(4)]
        for gen in separate:
            scheduler.add(gen.sequences[0])
        await run_steps(scheduler, client, 2)
        apart = blocks_held(scheduler)
        report = scheduler.kv.check_integrity()
        assert report.ok, report.errors
        await client.close()
        return forked, apart, outputs

    with ExecutorProcess(model_dirs["llama"], num_blocks=64) as executor:
        forked, apart, outputs = asyncio.run(main(executor))
    assert forked == 2 + 4
    assert apart == 4 * 3
    expected = hf_greedy(model_dirs["llama"], PROMPT, 6)
    assert outputs == [expected] * 4


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_async_stepping_sends_the_next_step_before_reading_a_sample(
    model_dirs: dict[str, Path], depth: int
) -> None:
    """Steps in flight: each continues from the one before's sample, which
    the scheduler has not seen yet; the output is still exact, and no step
    goes past the sequence's last token."""

    async def main(executor: ExecutorProcess) -> tuple[list[bool], int, list[int]]:
        client = ExecutorClient(executor.target, "test")
        info = await client.connect()
        scheduler = ExecutorScheduler(
            executor.target, info, client.owner, max_num_seqs=16, max_num_batched_tokens=512
        )
        gen = generation(scheduler, "async", 1)
        scheduler.add(gen.sequences[0])
        sent = await run_in_flight(
            scheduler, client, lambda: gen.sequences[0].finished, depth=depth
        )
        continued = [flag for s in sent for flag in s.request.continue_from_sampled]
        ahead = max(len(s.in_flight) for s in sent if s.request.continue_from_sampled)
        assert scheduler.kv.check_integrity().ok
        await client.close()
        return continued, ahead, list(gen.sequences[0].request.token_ids[len(PROMPT) :])

    with ExecutorProcess(model_dirs["llama"], num_blocks=64) as executor:
        continued, ahead, output = asyncio.run(main(executor))
    # After the prefill, every decode continued from a sample still in flight,
    # up to depth - 1 of them; the 6 tokens took a prefill and 5 decodes.
    assert continued == [False] + [True] * 5
    assert ahead == depth - 1
    assert output == hf_greedy(model_dirs["llama"], PROMPT, 6)
