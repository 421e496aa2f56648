"""A sequence never outgrows its executor's KV pool: one that would ends,
with FINISH_REASON_LENGTH, when its blocks fill the whole pool (as at
max_model_len), instead of preempting itself and waiting for good."""

from __future__ import annotations

from collections import deque

import pytest

from pagedkv.scheduler.bench.steps import executor_info, sampled_rows, step_response
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.sequence import FinishReason, Generation, Sequence
from pagedkv.v1 import common_pb2

NUM_BLOCKS = 8  # 7 usable blocks of 16 tokens: 112 tokens


@pytest.mark.parametrize(("depth", "window"), [(1, 1), (2, 1), (2, 4)])
def test_a_request_longer_than_the_pool_ends_with_length_when_the_pool_is_full(
    depth: int, window: int
) -> None:
    scheduler = ExecutorScheduler(
        "executor",
        executor_info(num_blocks=NUM_BLOCKS, max_num_rows=4),
        common_pb2.Owner(owner_id="test", epoch=1),
        max_num_seqs=4,
        max_num_batched_tokens=256,
        decode_window=window,
    )
    prompt = list(range(3, 53))  # 50 tokens, asking for 100 more
    generation = Generation(
        request_id="long",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        max_tokens=100,
        n=1,
        priority=0,
        cache_salt="",
        eos_token_ids=frozenset(),
        stop_token_ids=frozenset(),
        key=1,
    )
    request = scheduler.kv.make_request(generation.new_seq_id(), prompt, max_tokens=100)
    generation.sequences.append(Sequence(generation, 0, request))
    scheduler.add(generation.sequences[0])
    inflight: deque[ScheduledStep] = deque()
    for _ in range(200):
        step = scheduler.schedule()
        if step is not None:
            inflight.append(step)
        assert inflight, "nothing to step, and the request has not ended"
        if step is None or len(inflight) >= depth:
            sent = inflight.popleft()
            rows = sampled_rows(sent.request)
            assert not scheduler.process(sent, step_response(sent.request, [7] * len(rows))).errors
            generation.flush()
        if generation.done:
            break
    (seq,) = generation.sequences
    assert generation.done and seq.finish_reason == FinishReason.FINISH_REASON_LENGTH
    assert len(seq.request.token_ids) == (NUM_BLOCKS - 1) * 16
    assert scheduler.num_preemptions == 0
    assert scheduler.kv.check_integrity().ok
    assert scheduler.kv.pool.get_num_free_blocks() == NUM_BLOCKS - 1
