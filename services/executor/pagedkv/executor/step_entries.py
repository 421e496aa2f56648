"""Which rows a StepRequest or AllocateRequest names, for ``plan_message``
(step_plan.py): the rows it frees, its new requests (rows, ids, prompts,
sampling) and the rows of its other entries, checked against the executor's
rows; and the column checks the other parts use too.

Each check raises InvalidArgument (AlreadyExists for a live seq_id)
naming the field and index at fault, and changes nothing. The rules are the
ones documented in protos/pagedkv/v1/executor.proto.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagedkv.common.errors import AlreadyExists, InvalidArgument
from pagedkv.executor.rows import Rows
from pagedkv.executor.step_types import Limits, NewRow, RowSampling
from pagedkv.v1 import executor_pb2


def first(mask: np.ndarray) -> int:
    """The index of the first True in ``mask`` (which has one)."""
    return int(np.flatnonzero(mask)[0])


def check_rows_live(name: str, rows: np.ndarray, live: np.ndarray, max_rows: int) -> None:
    """Each of ``rows`` (the column ``name``) is below ``max_rows``, live, and
    not repeated."""
    if not len(rows):
        return
    bad = rows >= max_rows
    if bad.any():
        i = first(bad)
        raise InvalidArgument(f"{name}[{i}]: row {rows[i]} >= max_num_rows {max_rows}")
    bad = ~live[rows]
    if bad.any():
        i = first(bad)
        raise InvalidArgument(f"{name}[{i}]: row {rows[i]} is not live")
    if len(np.unique(rows)) != len(rows):
        raise InvalidArgument(f"{name}: rows repeat")


def check_tokens(name: str, tokens: np.ndarray, vocab_size: int) -> None:
    """Each of ``tokens`` (the column ``name``) is below ``vocab_size``."""
    if not len(tokens):
        return
    bad = tokens >= vocab_size
    if bad.any():
        i = first(bad)
        raise InvalidArgument(f"{name}[{i}]: token {tokens[i]} >= vocab_size {vocab_size}")


@dataclass(frozen=True, slots=True)
class Entries:
    """A message's rows: those freed first, then its entries (new requests,
    then rows the executor holds), each entry's row in ``rows``."""

    freed: np.ndarray  # int64 [num_freed]
    new_rows: list[NewRow]
    old_rows: np.ndarray  # int64 [num_entries - num_new]
    rows: np.ndarray  # int64 [num_entries]

    @property
    def num_new(self) -> int:
        return len(self.new_rows)

    @property
    def num_entries(self) -> int:
        return len(self.rows)

    @property
    def is_new(self) -> np.ndarray:
        return np.arange(self.num_entries) < self.num_new


def plan_entries(
    message: executor_pb2.StepRequest | executor_pb2.AllocateRequest,
    rows: Rows,
    limits: Limits,
) -> Entries:
    """Checks the freed rows, the new requests (on rows free once the freed
    ones go) and the rows of the other entries (live, and not a new
    request's)."""
    step = message if isinstance(message, executor_pb2.StepRequest) else None
    freed = np.asarray(step.freed_rows if step is not None else (), dtype=np.int64)
    check_rows_live("freed_rows", freed, rows.live, rows.max_num_rows)
    live_after = rows.live.copy()
    live_after[freed] = False
    new_rows = plan_new_requests(list(message.new_requests), rows, live_after, limits)
    old_rows = np.asarray(message.rows, dtype=np.int64)
    check_rows_live("rows", old_rows, live_after, rows.max_num_rows)
    if new_rows:
        new_row_ids = {n.row for n in new_rows}
        for i, row in enumerate(old_rows.tolist()):
            if row in new_row_ids:
                raise InvalidArgument(f"rows[{i}]: row {row} is taken by a new request")
    entry_rows = np.concatenate([np.asarray([n.row for n in new_rows], np.int64), old_rows])
    return Entries(freed, new_rows, old_rows, entry_rows)


def plan_new_requests(
    messages: list[executor_pb2.NewRequest],
    rows: Rows,
    live_after: np.ndarray,
    limits: Limits,
) -> list[NewRow]:
    """Checks ``new_requests``: each takes a row not live once the freed rows
    go (``live_after``) nor taken by another, with a seq_id not live."""
    taken: dict[int, int] = {}
    ids_after = {sid for sid, row in rows.row_of_seq.items() if live_after[row]}
    new_ids: set[str] = set()
    new_rows = []
    for i, message in enumerate(messages):
        name = f"new_requests[{i}]"
        row = message.row
        if row >= rows.max_num_rows:
            raise InvalidArgument(f"{name}.row: row {row} >= max_num_rows {rows.max_num_rows}")
        if live_after[row]:
            raise InvalidArgument(f"{name}.row: row {row} is live")
        if row in taken:
            raise InvalidArgument(f"{name}.row: row {row} is taken by new_requests[{taken[row]}]")
        taken[row] = i
        if not message.seq_id:
            raise InvalidArgument(f"{name}.seq_id: empty")
        if message.seq_id in ids_after or message.seq_id in new_ids:
            raise AlreadyExists(f"{name}.seq_id: {message.seq_id!r} is live")
        new_ids.add(message.seq_id)
        new_rows.append(_new_row(name, message, limits))
    return new_rows


def _new_row(name: str, message: executor_pb2.NewRequest, limits: Limits) -> NewRow:
    """Checks one new request's prompt and sampling (its row and id are checked)."""
    prompt = np.asarray(message.prompt_token_ids, dtype=np.int64)
    if len(prompt) > limits.max_model_len:
        raise InvalidArgument(
            f"{name}.prompt_token_ids: {len(prompt)} tokens > max_model_len {limits.max_model_len}"
        )
    check_tokens(f"{name}.prompt_token_ids", prompt, limits.vocab_size)
    if message.num_prompt_tokens > len(prompt):
        raise InvalidArgument(
            f"{name}.num_prompt_tokens: {message.num_prompt_tokens} > "
            f"{len(prompt)} prompt_token_ids"
        )
    sampling = RowSampling.from_proto(
        message.sampling, limits.eos_token_ids, message.num_prompt_tokens or len(prompt)
    )
    _check_sampling(f"{name}.sampling", sampling, limits)
    return NewRow(message.row, message.seq_id, prompt, sampling)


def _check_sampling(name: str, sampling: RowSampling, limits: Limits) -> None:
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise InvalidArgument(f"{name}.temperature: {sampling.temperature} is not >= 0")
    if not 0 < sampling.top_p <= 1:
        raise InvalidArgument(f"{name}.top_p: {sampling.top_p} is not in (0, 1]")
    if sampling.num_logprobs > limits.max_logprobs:
        raise InvalidArgument(
            f"{name}.logprobs: {sampling.num_logprobs} > max_logprobs {limits.max_logprobs}"
        )
    if sampling.min_tokens_ids and sampling.min_tokens_ids[-1] >= limits.vocab_size:
        raise InvalidArgument(
            f"{name}.stop_token_ids: token {sampling.min_tokens_ids[-1]} >= vocab_size "
            f"{limits.vocab_size}"
        )
