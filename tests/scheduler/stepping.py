"""The live ``ExecutorScheduler`` stepped without an executor: a scheduler
over a synthetic executor (``pagedkv.bench.scheduler.executor_sim.executor_info``),
generations added to it as the service adds them, and a loop that sends
steps, answers each as it is sent and applies the answers with some in
flight, as the service's step loop does."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from pagedkv.bench.scheduler.executor_sim import executor_info
from pagedkv.scheduler.beam import BeamSearch
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.sequence import Generation, Sequence
from pagedkv.v1 import common_pb2, executor_pb2

Respond = Callable[[executor_pb2.StepRequest], executor_pb2.StepResponse]


def live_scheduler(
    num_blocks: int,
    max_num_rows: int = 16,
    *,
    max_num_batched_tokens: int = 256,
    decode_window: int = 1,
) -> ExecutorScheduler:
    return ExecutorScheduler(
        "executor",
        executor_info(num_blocks=num_blocks, max_num_rows=max_num_rows),
        common_pb2.Owner(owner_id="test", epoch=1),
        max_num_seqs=max_num_rows,
        max_num_batched_tokens=max_num_batched_tokens,
        decode_window=decode_window,
    )


def add_generation(
    scheduler: ExecutorScheduler,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    *,
    key: int,
    sampling: common_pb2.SamplingParams | None = None,
    beam: BeamSearch | None = None,
    eos_token_ids: Iterable[int] = (),
    stop_token_ids: Iterable[int] = (),
    priority: int = 0,
    arrival: float | None = None,
) -> Generation:
    """A generation of one first sequence, queued (its forks or beams come
    as the scheduler makes them); ``arrival`` defaults to now."""
    sampling = sampling or common_pb2.SamplingParams(temperature=0.0)
    generation = Generation(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        n=sampling.n or 1,
        priority=priority,
        cache_salt="",
        eos_token_ids=frozenset(eos_token_ids),
        stop_token_ids=frozenset(stop_token_ids),
        beam=beam,
        key=key,
    )
    if arrival is not None:
        generation.arrival = arrival
    request = scheduler.kv.make_request(generation.new_seq_id(), prompt, max_tokens=max_tokens)
    generation.sequences.append(Sequence(generation, 0, request))
    scheduler.add(generation.sequences[0])
    return generation


def run_to_end(
    scheduler: ExecutorScheduler,
    generations: list[Generation],
    respond: Respond,
    depth: int,
    max_steps: int = 400,
) -> list[ScheduledStep]:
    """Steps until every generation is done, up to ``depth`` steps in flight,
    each answered by ``respond`` when sent, then applies what is still in
    flight; the steps sent. Fails when no step comes while a generation is
    unfinished, when applying raises, or after ``max_steps``."""
    inflight: deque[tuple[ScheduledStep, executor_pb2.StepResponse]] = deque()
    sent: list[ScheduledStep] = []
    for _ in range(max_steps):
        if all(g.done for g in generations):
            break
        step = scheduler.schedule()
        if step is not None:
            for early in step.before:  # copy-only messages go first
                inflight.append((ScheduledStep(early), respond(early)))
            sent.append(step)
            inflight.append((step, respond(step.request)))
        assert inflight, f"no step comes; {len(scheduler.waiting)} waiting"
        if step is None or len(inflight) >= depth:
            _apply(scheduler, *inflight.popleft())
    assert all(g.done for g in generations), f"unfinished after {max_steps} steps"
    while inflight:
        _apply(scheduler, *inflight.popleft())
    return sent


def _apply(
    scheduler: ExecutorScheduler, step: ScheduledStep, response: executor_pb2.StepResponse
) -> None:
    processed = scheduler.process(step, response)
    assert not processed.errors, processed.errors
    for generation in processed.touched:
        generation.flush()
