"""A step's one-token entries come first (``windows.decodes_first``): the
executor's attention takes a step's leading decodes in a launch of their
own, and a running decode after a prompt's chunk would be left in the
chunk's launch."""

from __future__ import annotations

from pagedkv.bench.scheduler.executor_sim import sampled_rows, step_response
from pagedkv.scheduler.windows import decodes_first
from tests.scheduler.stepping import add_generation, live_scheduler

BLOCK = 16  # tokens per block of the synthetic executor


def test_decodes_move_ahead_of_chunks_each_part_in_its_order() -> None:
    decisions = [("a", 40, None), ("b", 1, None), ("c", 7, None), ("d", 1, None)]
    assert decodes_first(decisions) == [  # type: ignore[arg-type]
        ("b", 1, None),
        ("d", 1, None),
        ("a", 40, None),
        ("c", 7, None),
    ]
    ordered = [("b", 1, None), ("a", 40, None)]
    assert decodes_first(ordered) is ordered  # type: ignore[arg-type]


def test_a_running_decode_precedes_a_more_important_requests_chunk() -> None:
    # C decodes; A, more important and arriving later, runs ahead of it in
    # (priority, arrival) order and computes the rest of its prompt beside
    # C's decode: the step sends C's decode first.
    scheduler = live_scheduler(num_blocks=64, max_num_batched_tokens=256)
    c = add_generation(scheduler, "c", list(range(3, 3 + BLOCK - 1)), 8, key=1, priority=5)

    def step() -> tuple[list[int], list[int]]:
        scheduled = scheduler.schedule()
        assert scheduled is not None
        message = scheduled.request
        response = step_response(message, [7] * len(sampled_rows(message)))
        processed = scheduler.process(scheduled, response)
        assert not processed.errors, processed.errors
        for generation in processed.touched:
            generation.flush()
        return list(message.rows), list(message.num_scheduled_tokens)

    step()  # C's prompt
    a = add_generation(scheduler, "a", list(range(3, 3 + 355)), 4, key=2, priority=0)
    rows_c = c.sequences[0].placed
    step()  # C's decode, then A's first 255 tokens
    rows_a = a.sequences[0].placed
    assert rows_c is not None and rows_a is not None
    rows, counts = step()  # A (ahead in the running order) has 100 left
    assert rows == [rows_c.row, rows_a.row] and counts == [1, 100]
