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

from typing import NamedTuple

from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.kv_cache_types import Allocation, TableUpdate
from pagedkv.scheduler.sequence import Sequence

Decision = tuple[Sequence, int, Allocation | None]
"""A decision of ``ExecutorScheduler.schedule``: a sequence, its tokens this
step, and its table changes (None: send the whole table)."""


class Window(NamedTuple):
    """How many decode steps a step runs (1: a plain step), and its
    decisions with the slots of that many steps."""

    num_steps: int
    decisions: list[Decision]


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


def window_steps(
    limit: int, anything_waiting: bool, kv: KVCacheManager, decisions: list[Decision]
) -> Window:
    """The decode steps this step can run, up to ``limit``, with the
    decisions' allocations grown to hold them (a new list; the block core
    ``kv`` allocates the slots). Needs every decision to be a plain decode,
    nothing waiting, and free blocks enough for every entry's window."""
    plain = Window(1, decisions)
    if limit <= 1 or anything_waiting or not decisions:
        return plain
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
            return plain
        # Its positions computed .. computed + N - 1 stay below its end.
        num_steps = min(num_steps, seq.max_num_tokens - seq.request.num_computed_tokens)
    if num_steps <= 1:
        return plain
    blocks_per_entry = -(-num_steps // kv.block_size) + 1
    if kv.pool.get_num_free_blocks() < blocks_per_entry * len(decisions):
        return plain
    covers = kv.covers
    windowed = list(decisions)
    for i, (seq, num, allocation) in enumerate(decisions):
        request = seq.request
        if covers(request, request.num_computed_tokens + num_steps):
            continue  # its blocks hold the window
        more = kv.allocate_slots(request, 0, num_lookahead_tokens=num_steps)
        if more is None:  # cannot happen with the blocks counted above
            return Window(1, windowed)  # (the slots given so far stay in the tables)
        assert allocation is not None
        windowed[i] = (seq, num, merge_allocations(allocation, more))
    return Window(num_steps, windowed)
