"""The tokens of a StepRequest's entries, for ``plan_message``
(step_plan.py): the per-entry columns (``num_scheduled_tokens``,
``num_computed_tokens``, ``continue_from_sampled``, ``needs_sample``), the
host tokens (``token_ids``) and the decode window (``num_decode_steps``, at
most the contract's ``MAX_DECODE_STEPS``), checked against the rows'
histories and the executor's limits. An AllocateRequest schedules nothing.

Each check raises InvalidArgument naming the field and index at fault, and
changes nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pagedkv.common.errors import InvalidArgument
from pagedkv.common.step_contract import MAX_DECODE_STEPS, ONE_STEP
from pagedkv.executor.rows import Rows
from pagedkv.executor.step_entries import Entries, check_tokens, first
from pagedkv.executor.step_types import Limits
from pagedkv.v1 import executor_pb2


class Columns(NamedTuple):
    """A message's per-entry token columns, and its host tokens (an
    AllocateRequest's: nothing scheduled)."""

    scheduled: np.ndarray  # int64 [num_entries]
    computed: np.ndarray  # int64 [num_entries]
    cont: np.ndarray  # bool [num_entries]: continue_from_sampled
    sample: np.ndarray  # bool [num_entries]: needs_sample
    tokens: np.ndarray  # int64 [num_tokens]: token_ids


def token_columns(step: executor_pb2.StepRequest | None, num_entries: int) -> Columns:
    """The per-entry columns, one value per entry each."""
    if step is None:
        nothing = np.zeros(num_entries, dtype=np.int64)
        no = np.zeros(num_entries, dtype=bool)
        return Columns(nothing, nothing, no, no, np.zeros(0, dtype=np.int64))
    columns = Columns(
        np.asarray(step.num_scheduled_tokens, dtype=np.int64),
        np.asarray(step.num_computed_tokens, dtype=np.int64),
        np.asarray(step.continue_from_sampled, dtype=bool),
        np.asarray(step.needs_sample, dtype=bool),
        np.asarray(step.token_ids, dtype=np.int64),
    )
    for name, column in (
        ("num_scheduled_tokens", columns.scheduled),
        ("num_computed_tokens", columns.computed),
        ("continue_from_sampled", columns.cont),
        ("needs_sample", columns.sample),
    ):
        if len(column) != num_entries:
            raise InvalidArgument(f"{name}: {len(column)} values for {num_entries} entries")
    return columns


class Tokens(NamedTuple):
    """What the entries' tokens come to."""

    history: np.ndarray  # per entry: its tokens once the last samples are appended
    continue_positions: np.ndarray  # where those samples go
    num_steps: int  # the decode window's steps (ONE_STEP: none)
    ends: np.ndarray  # per entry: its tokens once computed (a window's last step's too)
    needed: np.ndarray  # per entry: the tokens it needs from token_ids


def plan_tokens(
    step: executor_pb2.StepRequest | None,
    entries: Entries,
    columns: Columns,
    rows: Rows,
    limits: Limits,
) -> Tokens:
    """Checks the tokens: samples to continue from, the window, lengths within
    ``max_model_len``, computed counts within the history, ``token_ids`` just
    the ones missing, the step's total, and samples only where tokens run."""
    scheduled, computed, cont, sample, tokens = columns
    prompt_lens = np.asarray([len(n.prompt) for n in entries.new_rows], dtype=np.int64)
    history = np.concatenate([prompt_lens, rows.num_tokens[entries.old_rows]])
    pending = np.concatenate(
        [np.zeros(entries.num_new, bool), rows.pending_sample[entries.old_rows]]
    )
    bad = cont & (entries.is_new | ~pending)
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"continue_from_sampled[{i}]: row {entries.rows[i]} has no sample to append"
        )
    continue_positions = history[cont]
    history = history + cont
    num_steps = _plan_window(step, entries.num_new, columns)
    ends = computed + scheduled + (num_steps - 1)
    bad = (ends > limits.max_model_len) | (history > limits.max_model_len)
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"num_scheduled_tokens[{i}]: the row would reach {max(ends[i], history[i])} "
            f"tokens > max_model_len {limits.max_model_len}"
        )
    bad = computed > history
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"num_computed_tokens[{i}]: {computed[i]} > the row's {history[i]} tokens"
        )
    needed = np.maximum(computed + scheduled - history, 0)
    if len(tokens) != needed.sum():
        raise InvalidArgument(f"token_ids: {len(tokens)} ids, the entries need {needed.sum()}")
    check_tokens("token_ids", tokens, limits.vocab_size)
    if scheduled.sum() > limits.max_num_batched_tokens:
        raise InvalidArgument(
            f"num_scheduled_tokens: {scheduled.sum()} in all > max_num_batched_tokens "
            f"{limits.max_num_batched_tokens}"
        )
    bad = sample & (scheduled == 0)
    if bad.any():
        raise InvalidArgument(f"needs_sample[{first(bad)}]: the entry schedules no token")
    return Tokens(history, continue_positions, num_steps, ends, needed)


def _plan_window(step: executor_pb2.StepRequest | None, num_new: int, columns: Columns) -> int:
    """Checks a decode window (``num_decode_steps``, at most the contract's
    ``MAX_DECODE_STEPS``); returns its steps (``ONE_STEP``: none)."""
    num_steps = step.num_decode_steps if step is not None else 0
    if num_steps <= ONE_STEP:  # 0 (unset) too
        return ONE_STEP
    name = "num_decode_steps"
    if num_steps > MAX_DECODE_STEPS:
        raise InvalidArgument(f"{name}: {num_steps} > {MAX_DECODE_STEPS}")
    if num_new:
        raise InvalidArgument(f"{name}: a decode window has no new_requests")
    scheduled, sample = columns.scheduled, columns.sample
    if not len(scheduled) or not (scheduled == 1).all() or not sample.all():
        raise InvalidArgument(f"{name}: every entry of a decode window decodes 1 token and samples")
    if len(columns.tokens):
        raise InvalidArgument(f"{name}: a decode window sends no token_ids")
    return int(num_steps)
