"""A sequence never outgrows its executor's KV pool: one that would ends,
with FINISH_REASON_LENGTH, when its blocks fill the whole pool (as at
max_model_len), instead of preempting itself and waiting for good."""

from __future__ import annotations

import pytest

from pagedkv.bench.scheduler.executor_sim import sampled_rows, step_response
from pagedkv.scheduler.sequence import FinishReason
from tests.scheduler.stepping import add_generation, live_scheduler, run_to_end

NUM_BLOCKS = 8  # 7 usable blocks of 16 tokens: 112 tokens


@pytest.mark.parametrize(("depth", "window"), [(1, 1), (2, 1), (2, 4)])
def test_a_request_longer_than_the_pool_ends_with_length_when_the_pool_is_full(
    depth: int, window: int
) -> None:
    scheduler = live_scheduler(NUM_BLOCKS, 4, decode_window=window)
    # 50 prompt tokens, asking for 100 more.
    generation = add_generation(scheduler, "long", list(range(3, 53)), 100, key=1)
    run_to_end(
        scheduler,
        [generation],
        lambda message: step_response(message, [7] * len(sampled_rows(message))),
        depth,
    )
    (seq,) = generation.sequences
    assert seq.finish_reason == FinishReason.FINISH_REASON_LENGTH
    assert len(seq.request.token_ids) == (NUM_BLOCKS - 1) * 16
    assert scheduler.num_preemptions == 0
    assert scheduler.kv.check_integrity().ok
    assert scheduler.kv.pool.get_num_free_blocks() == NUM_BLOCKS - 1
