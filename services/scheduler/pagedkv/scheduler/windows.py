"""Decode windows: one step message that asks the executor for N decodes.

When every entry of a step is a plain one-token decode and nothing waits to
be admitted, ``ExecutorScheduler`` may turn the step into a window of N
decode steps (``StepRequest.num_decode_steps``, up to its
``decode_window``): the executor runs them back to back, each continuing
from the last one's samples on the device, and answers with N rounds of
samples. The per-step host work of both processes (scheduling, the message,
its checks and launches, the response) is then paid once for N tokens.

A window's entries get slots for N tokens; the samples are applied in step
order, each with its stop check, so a sequence that stops inside the window
ignores the rest of its samples (their slots go back when it is released).
Windows are pipelined as single steps are: a sequence with a window in
flight may be in the next one, which continues from the window's last
sample on the executor. Plain means: no beam search, one sequence per
generation (``n`` = 1), its table already on the executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.scheduler.kv_cache_types import Allocation, TableUpdate
from pagedkv.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from pagedkv.scheduler.executor_scheduler import ExecutorScheduler

# A decision of ``ExecutorScheduler.schedule``: a sequence, its tokens this
# step, and its table changes (None: send the whole table).
Decision = tuple[Sequence, int, Allocation | None]


def merge_allocations(first: Allocation, then: Allocation) -> Allocation:
    """Two table changes of one request, made in turn, as one."""
    if not then.updates:
        return first
    if not first.updates:
        return then
    merged = []
    for a, b in zip(first.updates, then.updates, strict=True):
        if not b.block_ids:
            merged.append(a)
        elif b.start <= a.start:
            merged.append(b)  # a later update defines the row from its start on
        else:
            merged.append(TableUpdate(a.start, a.block_ids[: b.start - a.start] + b.block_ids))
    return Allocation(tuple(merged))


def window_steps(scheduler: ExecutorScheduler, decisions: list[Decision]) -> int:
    """The decode steps this step can run (1: a plain step), having given
    every entry the slots of a window that long (``decisions`` are updated
    in place). Needs every decision to be a plain decode, nothing waiting,
    and free blocks enough for every entry's window."""
    limit = scheduler.decode_window
    if limit <= 1 or scheduler.waiting or not decisions:
        return 1
    kv = scheduler.kv
    num_steps = limit
    for seq, num, allocation in decisions:
        generation = seq.generation
        placed = seq.placed
        if (
            num != 1
            or allocation is None
            or generation.beam is not None
            or generation.n != 1
            or placed is None
            or placed.table_lengths is None
        ):
            return 1
        # Its positions computed .. computed + N - 1 stay below its end.
        num_steps = min(num_steps, seq.max_num_tokens - seq.request.num_computed_tokens)
    if num_steps <= 1:
        return 1
    blocks_per_entry = -(-num_steps // kv.block_size) + 1
    if kv.pool.get_num_free_blocks() < blocks_per_entry * len(decisions):
        return 1
    covers = kv.covers
    for i, (seq, num, allocation) in enumerate(decisions):
        request = seq.request
        if covers(request, request.num_computed_tokens + num_steps):
            continue  # its blocks hold the window
        more = kv.allocate_slots(request, 0, num_lookahead_tokens=num_steps)
        if more is None:  # cannot happen with the blocks counted above
            return 1
        assert allocation is not None
        decisions[i] = (seq, num, merge_allocations(allocation, more))
    return num_steps
