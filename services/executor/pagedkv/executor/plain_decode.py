"""The common step message's plan, in a few vector operations.

Most step messages of a running batch are plain decodes: every entry a row
the executor holds, one token continued from its pending sample, a sample
asked for, no table changes, no tokens from the host, nothing freed, copied,
tagged, offloaded or loaded (host tier), one step. ``plain_decode_plan``
recognises such a message and makes its ``StepPlan`` without the general
path's per-part checks (some 250 numpy and Python calls per message, a fixed
cost that a single step pays every step). It accepts a message only when
every condition it checks holds; those conditions imply every check of
``plan_message``, and the plan it makes is the one ``plan_message`` makes
(tests/executor/test_plain_decode.py compares them). Anything else, a bad
message included, returns None: the general path then plans it or names the
field at fault.
"""

from __future__ import annotations

import numpy as np

from pagedkv.common.step_contract import ONE_STEP
from pagedkv.executor.rows import Rows
from pagedkv.executor.step_transfers import has_transfers
from pagedkv.executor.step_types import (
    NO_IDS,
    NO_PAIRS,
    NO_TAGS,
    Limits,
    StepPlan,
)
from pagedkv.v1 import executor_pb2


def plain_decode_plan(
    step: executor_pb2.StepRequest, rows: Rows, limits: Limits
) -> StepPlan | None:
    """The plan of a plain decode message (see the module docstring), or None."""
    num_entries = len(step.rows)
    if (
        not num_entries
        or step.new_requests
        or step.freed_rows
        or step.token_ids
        or step.new_block_ids
        or step.copy_src_block_ids
        or step.copy_dst_block_ids
        or step.untag_block_ids
        or step.tag_block_ids
        or step.tag_block_hashes
        or step.tag_group_ids
        or has_transfers(step)
        or step.num_decode_steps > ONE_STEP
        or num_entries > limits.max_num_batched_tokens
    ):
        return None
    num_groups = rows.num_groups
    columns = (
        step.num_scheduled_tokens,
        step.num_computed_tokens,
        step.continue_from_sampled,
        step.needs_sample,
    )
    if any(len(column) != num_entries for column in columns):
        return None
    if len(step.block_table_starts) != num_entries * num_groups:
        return None
    if len(step.new_block_counts) != num_entries * num_groups:
        return None
    entry_rows = np.asarray(step.rows, dtype=np.int64)
    if int(entry_rows.max()) >= rows.max_num_rows:
        return None
    scheduled = np.asarray(step.num_scheduled_tokens, dtype=np.int64)
    computed = np.asarray(step.num_computed_tokens, dtype=np.int64)
    cont = np.asarray(step.continue_from_sampled, dtype=bool)
    sample = np.asarray(step.needs_sample, dtype=bool)
    counts = np.asarray(step.new_block_counts, dtype=np.int64)
    starts = np.asarray(step.block_table_starts, dtype=np.int64)
    history = rows.num_tokens[entry_rows]  # before the samples are appended
    ends = computed + 1
    current = rows.num_blocks[:, entry_rows].T.reshape(-1)  # entry-major, as the columns
    if not (
        rows.live[entry_rows].all()
        and rows.pending_sample[entry_rows].all()
        and np.count_nonzero(np.bincount(entry_rows)) == num_entries  # no row repeats
        and (scheduled == 1).all()
        and cont.all()
        and sample.all()
        and (computed == history).all()
        and int(ends.max()) <= limits.max_model_len
        and not counts.any()
        and (starts == current).all()
        and (starts.reshape(num_entries, num_groups) * limits.block_size >= ends[:, None]).all()
    ):
        return None
    group_of = np.tile(np.arange(num_groups), num_entries)
    row_of = np.repeat(entry_rows, num_groups)
    return StepPlan(
        offloads=NO_PAIRS,
        loads=NO_PAIRS,
        untag_block_ids=(),
        freed_rows=[],
        new_rows=[],
        table_groups=NO_IDS,
        table_rows=NO_IDS,
        table_columns=NO_IDS,
        table_block_ids=NO_IDS,
        table_lengths=np.stack([group_of, row_of, starts]),
        copies=NO_PAIRS,
        continue_rows=entry_rows,
        continue_positions=history,
        token_rows=NO_IDS,
        token_positions=NO_IDS,
        token_values=NO_IDS,
        history_rows=entry_rows,
        history_lengths=history + 1,
        rows=entry_rows,
        num_computed=computed,
        num_scheduled=scheduled,
        needs_sample=sample,
        tags=NO_TAGS,
        num_steps=ONE_STEP,
    )
