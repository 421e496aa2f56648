"""A beam preempted while its generation's round waits for another beam
drops its candidates: the round waits for it to sample again."""

from __future__ import annotations

from pagedkv.scheduler.beam import BeamSearch
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.sequence import SequenceState
from pagedkv.v1 import common_pb2, executor_pb2
from tests.scheduler.stepping import add_generation, live_scheduler

NUM_CANDIDATES = 4


def respond(step: ScheduledStep, token: int) -> executor_pb2.StepResponse:
    """An executor's answer: every sample with the same top candidates."""
    message = step.request
    rows = [r.row for r in message.new_requests] + list(message.rows)
    sampled = [row for row, needs in zip(rows, message.needs_sample, strict=True) if needs]
    return executor_pb2.StepResponse(
        step_id=message.step_id,
        sampled_rows=sampled,
        sampled_token_ids=[token] * len(sampled),
        sampled_logprobs=[-0.1] * len(sampled),
        num_top_logprobs=[NUM_CANDIDATES] * len(sampled),
        top_token_ids=[token + i for i in range(NUM_CANDIDATES)] * len(sampled),
        top_logprobs=[-0.1 * (i + 1) for i in range(NUM_CANDIDATES)] * len(sampled),
    )


def step(scheduler: ExecutorScheduler, token: int) -> None:
    """Schedules a step and applies its answer (nothing may fail), then
    queues the chunks of the generations with news, as the service does."""
    scheduled = scheduler.schedule()
    assert scheduled is not None
    processed = scheduler.process(scheduled, respond(scheduled, token))
    assert not processed.errors, processed.errors
    for generation in processed.touched:
        generation.flush()


def test_a_preempted_beam_is_not_extended_with_candidates_from_before() -> None:
    scheduler = live_scheduler(64, 8, max_num_batched_tokens=512)
    sampling = common_pb2.SamplingParams(temperature=0.0, beam_width=2)
    beam = BeamSearch(2, NUM_CANDIDATES)
    generation = add_generation(
        scheduler, "beams", list(range(10, 30)), 6, key=1, sampling=sampling, beam=beam
    )
    step(scheduler, 100)  # the prompt; the first round forks the second beam
    first, second = generation.sequences
    assert first.state is second.state is SequenceState.RUNNING

    both = scheduler.schedule()  # both beams decode
    assert both is not None
    scheduler._preempt(second)  # its sample is stale now: the round waits for it
    assert not scheduler.process(both, respond(both, 200)).errors
    assert [beam.candidates is None for beam in (first, second)] == [False, True]
    scheduler._preempt(first)  # its candidates are for KV it no longer holds
    assert first.candidates is None

    for token in range(300, 320):  # both recompute and the search goes on to its end
        if generation.done:
            break
        step(scheduler, token)
    assert generation.done and generation.beam is not None
    assert [len(beam.token_ids) for beam in generation.beam.best()] == [6, 6]
    assert scheduler.kv.check_integrity().ok
