"""Checks a StepRequest or AllocateRequest against the executor's rows and
limits, and turns it into a ``StepPlan``: the one place where wire messages
become arrays.

Every check runs before anything is changed, so a refused message leaves the
executor as it was. Errors name the field (and index) at fault. The rules are
the ones documented in protos/pagedkv/v1/executor.proto.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.common.errors import AlreadyExists, InvalidArgument
from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.common.step_contract import MAX_DECODE_STEPS, ONE_STEP
from pagedkv.executor.block_tags import MAX_BLOCK_HASH_BYTES, TagColumns
from pagedkv.executor.rows import Rows, RowSampling
from pagedkv.v1 import executor_pb2

_EMPTY = np.zeros(0, dtype=np.int64)
_NO_COPIES = np.zeros((0, 2), dtype=np.int64)
_NO_TAGS = TagColumns((), (), ())


@dataclass(frozen=True, slots=True)
class Limits:
    """What the executor accepts; fixed for its incarnation."""

    num_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_logprobs: int
    group_windowed: tuple[bool, ...]  # per group: sliding window (the null block is allowed)
    eos_token_ids: tuple[int, ...] = ()  # the model's (sampling.min_tokens masks them)


@dataclass(frozen=True, slots=True)
class NewRow:
    row: int
    request_id: str
    prompt: np.ndarray  # int64 [prompt_len]
    sampling: RowSampling


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A validated message, in the order its effects apply (see executor.proto)."""

    untag_block_ids: Sequence[BlockId]  # their tags go first
    freed_rows: list[int]
    new_rows: list[NewRow]
    # Block-table writes: (group, row, column) <- block id; then each
    # (group, row) gets its new length: table_lengths is [3, n].
    table_groups: np.ndarray
    table_rows: np.ndarray
    table_columns: np.ndarray
    table_block_ids: np.ndarray
    table_lengths: np.ndarray
    copies: np.ndarray  # int64 [num_copies, 2]: (src, dst)
    # Token appends: last samples at (row, position), then host tokens.
    continue_rows: np.ndarray
    continue_positions: np.ndarray
    token_rows: np.ndarray
    token_positions: np.ndarray
    token_values: np.ndarray
    history_rows: np.ndarray  # rows whose history length changes ...
    history_lengths: np.ndarray  # ... to this
    # The forward: entries with tokens to run, in entry order.
    rows: np.ndarray  # int64 [num_run]
    num_computed: np.ndarray  # int64 [num_run]: position of the first token
    num_scheduled: np.ndarray  # int64 [num_run]
    needs_sample: np.ndarray  # bool [num_run]
    tags: TagColumns  # set once the forward and sampling have finished
    num_steps: int = ONE_STEP  # a decode window's steps (see num_decode_steps)

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())


def _check_rows_live(name: str, rows: np.ndarray, live: np.ndarray, max_rows: int) -> None:
    if not len(rows):
        return
    bad = rows >= max_rows
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"{name}[{i}]: row {rows[i]} >= max_num_rows {max_rows}")
    bad = ~live[rows]
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"{name}[{i}]: row {rows[i]} is not live")
    if len(np.unique(rows)) != len(rows):
        raise InvalidArgument(f"{name}: rows repeat")


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_tokens(name: str, tokens: np.ndarray, vocab_size: int) -> None:
    if not len(tokens):
        return
    bad = tokens >= vocab_size
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"{name}[{i}]: token {tokens[i]} >= vocab_size {vocab_size}")


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


def _plan_new_requests(
    messages: list[executor_pb2.NewRequest],
    rows: Rows,
    live_after: np.ndarray,
    limits: Limits,
) -> list[NewRow]:
    taken: dict[int, int] = {}
    ids_after = {rid for rid, row in rows.row_of_request.items() if live_after[row]}
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
        if not message.request_id:
            raise InvalidArgument(f"{name}.request_id: empty")
        if message.request_id in ids_after or message.request_id in new_ids:
            raise AlreadyExists(f"{name}.request_id: {message.request_id!r} is live")
        new_ids.add(message.request_id)
        prompt = np.asarray(message.prompt_token_ids, dtype=np.int64)
        if len(prompt) > limits.max_model_len:
            raise InvalidArgument(
                f"{name}.prompt_token_ids: {len(prompt)} tokens > max_model_len "
                f"{limits.max_model_len}"
            )
        _check_tokens(f"{name}.prompt_token_ids", prompt, limits.vocab_size)
        if message.num_prompt_tokens > len(prompt):
            raise InvalidArgument(
                f"{name}.num_prompt_tokens: {message.num_prompt_tokens} > "
                f"{len(prompt)} prompt_token_ids"
            )
        sampling = RowSampling.from_proto(
            message.sampling, limits.eos_token_ids, message.num_prompt_tokens or len(prompt)
        )
        _check_sampling(f"{name}.sampling", sampling, limits)
        new_rows.append(NewRow(row, message.request_id, prompt, sampling))
    return new_rows


def plan_copies(
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    limits: Limits,
    names: tuple[str, str] = ("copy_src_block_ids", "copy_dst_block_ids"),
) -> np.ndarray:
    """Checks block copies (a step's columns, or CopyBlocksRequest's, whose
    field ``names`` the errors use); returns int64 ``[n, 2]``: (src, dst)."""
    if not len(src_ids) and not len(dst_ids):
        return _NO_COPIES
    src_name, dst_name = names
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if len(src) != len(dst):
        raise InvalidArgument(f"{dst_name}: {len(dst)} ids for {len(src)} {src_name}")
    for name, ids in ((src_name, src), (dst_name, dst)):
        bad = (ids == 0) | (ids >= limits.num_blocks)
        if bad.any():
            i = _first(bad)
            raise InvalidArgument(
                f"{name}[{i}]: block {ids[i]} is the null block or >= num_blocks "
                f"{limits.num_blocks}"
            )
    if len(set(dst.tolist())) != len(dst) or set(dst.tolist()) & set(src.tolist()):
        raise InvalidArgument(f"{dst_name}: repeated, or also a source")
    return np.stack([src, dst], axis=1)


def _check_tag_block_ids(name: str, block_ids: np.ndarray, limits: Limits) -> None:
    bad = block_ids >= limits.num_blocks
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(
            f"{name}[{i}]: block {block_ids[i]} >= num_blocks {limits.num_blocks}"
        )
    bad = block_ids == 0
    if bad.any():
        raise InvalidArgument(f"{name}[{_first(bad)}]: the null block 0 is never tagged")


def _plan_untags(step: executor_pb2.StepRequest, limits: Limits) -> Sequence[BlockId]:
    """Checks ``untag_block_ids`` (repeats and untagged blocks are allowed)."""
    block_ids = np.asarray(step.untag_block_ids, dtype=np.int64)
    _check_tag_block_ids("untag_block_ids", block_ids, limits)
    return [BlockId(b) for b in block_ids.tolist()]


def _plan_tags(step: executor_pb2.StepRequest, limits: Limits) -> TagColumns:
    """Checks the tag columns: ids in range, not 0 and distinct; one hash of 1
    to ``MAX_BLOCK_HASH_BYTES`` bytes and one KV cache group per id."""
    block_ids = np.asarray(step.tag_block_ids, dtype=np.int64)
    hashes = list(step.tag_block_hashes)
    group_ids = np.asarray(step.tag_group_ids, dtype=np.int64)
    for name, column in (("tag_block_hashes", hashes), ("tag_group_ids", group_ids)):
        if len(column) != len(block_ids):
            raise InvalidArgument(
                f"{name}: {len(column)} values for {len(block_ids)} tag_block_ids"
            )
    _check_tag_block_ids("tag_block_ids", block_ids, limits)
    ids = block_ids.tolist()
    if len(set(ids)) != len(ids):
        first: dict[int, int] = {}
        for i, block_id in enumerate(ids):
            if block_id in first:
                raise InvalidArgument(
                    f"tag_block_ids[{i}]: block {block_id} repeats tag_block_ids[{first[block_id]}]"
                )
            first[block_id] = i
    for i, block_hash in enumerate(hashes):
        if not 1 <= len(block_hash) <= MAX_BLOCK_HASH_BYTES:
            raise InvalidArgument(
                f"tag_block_hashes[{i}]: {len(block_hash)} bytes, not 1 to {MAX_BLOCK_HASH_BYTES}"
            )
    num_groups = len(limits.group_windowed)
    bad = group_ids >= num_groups
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(
            f"tag_group_ids[{i}]: group {group_ids[i]} >= {num_groups} kv_cache_groups"
        )
    return TagColumns(
        [BlockId(b) for b in ids],
        [BlockHash(h) for h in hashes],
        group_ids.tolist(),
    )


def _plan_window(
    step: executor_pb2.StepRequest | None,
    num_new: int,
    scheduled: np.ndarray,
    sample: np.ndarray,
    tokens: np.ndarray,
) -> int:
    """Checks a decode window (``num_decode_steps``); returns its steps (1:
    none)."""
    num_steps = step.num_decode_steps if step is not None else 0
    if num_steps <= ONE_STEP:  # 0 (unset) too
        return ONE_STEP
    name = "num_decode_steps"
    if num_steps > MAX_DECODE_STEPS:
        raise InvalidArgument(f"{name}: {num_steps} > {MAX_DECODE_STEPS}")
    if num_new:
        raise InvalidArgument(f"{name}: a decode window has no new_requests")
    if not len(scheduled) or not (scheduled == 1).all() or not sample.all():
        raise InvalidArgument(f"{name}: every entry of a decode window decodes 1 token and samples")
    if len(tokens):
        raise InvalidArgument(f"{name}: a decode window sends no token_ids")
    return int(num_steps)


def plan_message(
    message: executor_pb2.StepRequest | executor_pb2.AllocateRequest,
    rows: Rows,
    limits: Limits,
) -> StepPlan:
    """Validates ``message`` against ``rows`` (not changed) and ``limits``.

    Raises InvalidArgument or AlreadyExists naming the field.
    """
    step = message if isinstance(message, executor_pb2.StepRequest) else None
    num_groups = rows.num_groups
    untags: Sequence[BlockId] = ()
    if step is not None and step.untag_block_ids:
        untags = _plan_untags(step, limits)
    freed = np.asarray(step.freed_rows if step is not None else (), dtype=np.int64)
    _check_rows_live("freed_rows", freed, rows.live, rows.max_num_rows)
    live_after = rows.live.copy()
    live_after[freed] = False
    new_rows = _plan_new_requests(list(message.new_requests), rows, live_after, limits)
    old_rows = np.asarray(message.rows, dtype=np.int64)
    _check_rows_live("rows", old_rows, live_after, rows.max_num_rows)
    if new_rows:
        new_row_ids = {n.row for n in new_rows}
        for i, row in enumerate(old_rows.tolist()):
            if row in new_row_ids:
                raise InvalidArgument(f"rows[{i}]: row {row} is taken by a new request")
    num_new = len(new_rows)
    entry_rows = np.concatenate([np.asarray([n.row for n in new_rows], np.int64), old_rows])
    num_entries = len(entry_rows)
    is_new = np.arange(num_entries) < num_new

    # Block tables.
    starts = np.asarray(message.block_table_starts, dtype=np.int64)
    counts = np.asarray(message.new_block_counts, dtype=np.int64)
    for name, column in (("block_table_starts", starts), ("new_block_counts", counts)):
        if len(column) != num_entries * num_groups:
            raise InvalidArgument(
                f"{name}: {len(column)} values, expected {num_entries * num_groups} "
                f"({num_entries} entries x {num_groups} groups)"
            )
    block_ids = np.asarray(message.new_block_ids, dtype=np.int64)
    if len(block_ids) != counts.sum():
        raise InvalidArgument(
            f"new_block_ids: {len(block_ids)} ids, new_block_counts sum to {counts.sum()}"
        )
    entry_of = np.repeat(np.arange(num_entries), num_groups)
    group_of = np.tile(np.arange(num_groups), num_entries)
    row_of = entry_rows[entry_of]
    current = np.where(is_new[entry_of], 0, rows.num_blocks[group_of, row_of])
    bad = starts > current
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(
            f"block_table_starts[{i}]: {starts[i]} > the row's {current[i]} blocks"
        )
    lengths = starts + counts
    max_blocks = rows.max_blocks_per_row
    bad = lengths > max_blocks
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(
            f"new_block_counts[{i}]: the row would hold {lengths[i]} blocks > {max_blocks}"
        )
    if len(block_ids):
        id_groups = np.repeat(group_of, counts)
        bad = block_ids >= limits.num_blocks
        if bad.any():
            i = _first(bad)
            raise InvalidArgument(
                f"new_block_ids[{i}]: block {block_ids[i]} >= num_blocks {limits.num_blocks}"
            )
        windowed = np.asarray(limits.group_windowed, dtype=bool)
        bad = (block_ids == 0) & ~windowed[id_groups]
        if bad.any():
            i = _first(bad)
            raise InvalidArgument(f"new_block_ids[{i}]: the null block 0 in a full-attention group")
        id_offsets = np.arange(len(block_ids)) - np.repeat(np.cumsum(counts) - counts, counts)
        table_columns = np.repeat(starts, counts) + id_offsets
        table_rows = np.repeat(row_of, counts)
    else:  # no table changes (most decode steps)
        id_groups = table_columns = table_rows = _EMPTY

    copies = plan_copies(
        step.copy_src_block_ids if step is not None else (),
        step.copy_dst_block_ids if step is not None else (),
        limits,
    )

    # Tokens.
    if step is not None:
        scheduled = np.asarray(step.num_scheduled_tokens, dtype=np.int64)
        computed = np.asarray(step.num_computed_tokens, dtype=np.int64)
        cont = np.asarray(step.continue_from_sampled, dtype=bool)
        sample = np.asarray(step.needs_sample, dtype=bool)
        tokens = np.asarray(step.token_ids, dtype=np.int64)
    else:
        scheduled = computed = np.zeros(num_entries, dtype=np.int64)
        cont = sample = np.zeros(num_entries, dtype=bool)
        tokens = _EMPTY
    for name, column in (
        ("num_scheduled_tokens", scheduled),
        ("num_computed_tokens", computed),
        ("continue_from_sampled", cont),
        ("needs_sample", sample),
    ):
        if len(column) != num_entries:
            raise InvalidArgument(f"{name}: {len(column)} values for {num_entries} entries")
    prompt_lens = np.asarray([len(n.prompt) for n in new_rows], dtype=np.int64)
    history = np.concatenate([prompt_lens, rows.num_tokens[old_rows]])
    bad = cont & (
        is_new | ~np.concatenate([np.zeros(num_new, bool), rows.pending_sample[old_rows]])
    )
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(
            f"continue_from_sampled[{i}]: row {entry_rows[i]} has no sample to append"
        )
    continue_positions = history[cont]
    history = history + cont
    num_steps = _plan_window(step, num_new, scheduled, sample, tokens)
    # The last token each entry computes (a window's last step's).
    ends = computed + scheduled + (num_steps - 1)
    bad = (ends > limits.max_model_len) | (history > limits.max_model_len)
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(
            f"num_scheduled_tokens[{i}]: the row would reach {max(ends[i], history[i])} "
            f"tokens > max_model_len {limits.max_model_len}"
        )
    bad = computed > history
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(
            f"num_computed_tokens[{i}]: {computed[i]} > the row's {history[i]} tokens"
        )
    needed = np.maximum(computed + scheduled - history, 0)
    if len(tokens) != needed.sum():
        raise InvalidArgument(f"token_ids: {len(tokens)} ids, the entries need {needed.sum()}")
    _check_tokens("token_ids", tokens, limits.vocab_size)
    if scheduled.sum() > limits.max_num_batched_tokens:
        raise InvalidArgument(
            f"num_scheduled_tokens: {scheduled.sum()} in all > max_num_batched_tokens "
            f"{limits.max_num_batched_tokens}"
        )
    bad = sample & (scheduled == 0)
    if bad.any():
        raise InvalidArgument(f"needs_sample[{_first(bad)}]: the entry schedules no token")
    covered = lengths.reshape(num_entries, num_groups) * limits.block_size
    bad = covered < ends[:, None]
    if bad.any():
        e, g = np.argwhere(bad)[0]
        raise InvalidArgument(
            f"new_block_counts[{e * num_groups + g}]: {covered[e, g] // limits.block_size} "
            f"blocks do not cover {ends[e]} tokens"
        )
    tags = _NO_TAGS
    if step is not None and (step.tag_block_ids or step.tag_block_hashes or step.tag_group_ids):
        tags = _plan_tags(step, limits)

    # Host tokens: each new row's prompt, then every entry's needed tokens.
    token_rows = [np.full(len(n.prompt), n.row, dtype=np.int64) for n in new_rows]
    token_positions = [np.arange(len(n.prompt), dtype=np.int64) for n in new_rows]
    token_rows.append(np.repeat(entry_rows, needed))
    token_positions.append(
        np.repeat(history, needed)
        + np.arange(needed.sum())
        - np.repeat(np.cumsum(needed) - needed, needed)
    )
    run = scheduled > 0
    return StepPlan(
        untag_block_ids=untags,
        freed_rows=freed.tolist(),
        new_rows=new_rows,
        table_groups=id_groups,
        table_rows=table_rows,
        table_columns=table_columns,
        table_block_ids=block_ids,
        table_lengths=np.stack([group_of, row_of, lengths]),
        copies=copies,
        continue_rows=entry_rows[cont],
        continue_positions=continue_positions,
        token_rows=np.concatenate(token_rows),
        token_positions=np.concatenate(token_positions),
        token_values=np.concatenate([*(n.prompt for n in new_rows), tokens]),
        history_rows=entry_rows,
        history_lengths=np.maximum(history, ends),  # a window appends its samples
        rows=entry_rows[run],
        num_computed=computed[run],
        num_scheduled=scheduled[run],
        needs_sample=sample[run],
        tags=tags,
        num_steps=num_steps,
    )
