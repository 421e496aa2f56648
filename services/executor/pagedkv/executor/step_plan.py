"""Checks a StepRequest or AllocateRequest against the executor's rows and
limits, and turns it into a ``StepPlan``: the one place where wire messages
become arrays.

Every check runs before anything is changed, so a refused message leaves the
executor as it was. Errors name the field (and index) at fault. The rules are
the ones documented in protos/pagedkv/v1/executor.proto; the limits both sides
of the wire share (the longest decode window) are in
``pagedkv.common.step_contract``.

The checks are split by what they read, and run in the order of the
message's effects: step_transfers.py the host tier's offloads and loads;
this module the plan, its limits, ``plan_message`` (which calls each part in
turn), the block tables, copies and tags; step_entries.py the rows a message
names (freed rows, new requests, the other entries); step_tokens.py the
entries' tokens and decode windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pagedkv.common.errors import InvalidArgument
from pagedkv.common.ids import NULL_BLOCK_ID, BlockHash, BlockId
from pagedkv.executor.block_tags import MAX_BLOCK_HASH_BYTES, TagColumns
from pagedkv.executor.plain_decode import plain_decode_plan
from pagedkv.executor.rows import Rows
from pagedkv.executor.step_entries import Entries, first, plan_entries
from pagedkv.executor.step_tokens import Columns, Tokens, plan_tokens, token_columns
from pagedkv.executor.step_transfers import (
    NO_HOST_COPIES,
    Transfers,
    check_block_ids,
    pair_columns,
    plan_transfers,
)
from pagedkv.executor.step_types import NO_IDS, NO_TAGS, Limits, StepPlan
from pagedkv.v1 import executor_pb2


def plan_message(
    message: executor_pb2.StepRequest | executor_pb2.AllocateRequest,
    rows: Rows,
    limits: Limits,
) -> StepPlan:
    """Validates ``message`` against ``rows`` (not changed) and ``limits``.

    Raises InvalidArgument or AlreadyExists naming the field. A plain decode
    message takes the short path (plain_decode.py).
    """
    if isinstance(message, executor_pb2.StepRequest):
        plain = plain_decode_plan(message, rows, limits)
        if plain is not None:
            return plain
    return plan_general(message, rows, limits)


def plan_general(
    message: executor_pb2.StepRequest | executor_pb2.AllocateRequest,
    rows: Rows,
    limits: Limits,
) -> StepPlan:
    """``plan_message`` by the general path: every part checked in turn."""
    step = message if isinstance(message, executor_pb2.StepRequest) else None
    transfers = plan_transfers(step, limits) if step is not None else NO_HOST_COPIES
    untags: Sequence[BlockId] = ()
    if step is not None and step.untag_block_ids:
        untags = _plan_untags(step, limits)
    entries = plan_entries(message, rows, limits)
    tables = _plan_tables(message, entries, rows, limits)
    copies = plan_copies(
        step.copy_src_block_ids if step is not None else (),
        step.copy_dst_block_ids if step is not None else (),
        limits,
    )
    columns = token_columns(step, entries.num_entries)
    tokens = plan_tokens(step, entries, columns, rows, limits)
    _check_coverage(tables, tokens.ends, rows.num_groups, limits.block_size)
    tags = NO_TAGS
    if step is not None and (step.tag_block_ids or step.tag_block_hashes or step.tag_group_ids):
        tags = _plan_tags(step, limits)
    return _step_plan(transfers, untags, entries, tables, copies, columns, tokens, tags)


def plan_copies(
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    limits: Limits,
    names: tuple[str, str] = ("copy_src_block_ids", "copy_dst_block_ids"),
) -> np.ndarray:
    """Checks block copies (a step's columns, or CopyBlocksRequest's, whose
    field ``names`` the errors use); returns int64 ``[n, 2]``: (src, dst)."""
    src_name, dst_name = names
    pairs = pair_columns((src_name, src_ids), (dst_name, dst_ids))
    if not len(pairs):  # most steps: no copy
        return pairs
    src, dst = pairs[:, 0], pairs[:, 1]
    check_block_ids(src_name, src, limits)
    check_block_ids(dst_name, dst, limits)
    if len(set(dst.tolist())) != len(dst) or set(dst.tolist()) & set(src.tolist()):
        raise InvalidArgument(f"{dst_name}: repeated, or also a source")
    return pairs


def _check_tag_block_ids(name: str, block_ids: np.ndarray, limits: Limits) -> None:
    bad = block_ids >= limits.num_blocks
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"{name}[{i}]: block {block_ids[i]} >= num_blocks {limits.num_blocks}"
        )
    bad = block_ids == NULL_BLOCK_ID
    if bad.any():
        raise InvalidArgument(f"{name}[{first(bad)}]: the null block 0 is never tagged")


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
        seen: dict[int, int] = {}
        for i, block_id in enumerate(ids):
            if block_id in seen:
                raise InvalidArgument(
                    f"tag_block_ids[{i}]: block {block_id} repeats tag_block_ids[{seen[block_id]}]"
                )
            seen[block_id] = i
    for i, block_hash in enumerate(hashes):
        if not 1 <= len(block_hash) <= MAX_BLOCK_HASH_BYTES:
            raise InvalidArgument(
                f"tag_block_hashes[{i}]: {len(block_hash)} bytes, not 1 to {MAX_BLOCK_HASH_BYTES}"
            )
    num_groups = len(limits.group_windowed)
    bad = group_ids >= num_groups
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"tag_group_ids[{i}]: group {group_ids[i]} >= {num_groups} kv_cache_groups"
        )
    return TagColumns(
        [BlockId(b) for b in ids],
        [BlockHash(h) for h in hashes],
        group_ids.tolist(),
    )


class _Tables(NamedTuple):
    """A message's block-table changes (see ``StepPlan``)."""

    groups: np.ndarray  # per new block id: its group, row and column
    rows: np.ndarray
    columns: np.ndarray
    block_ids: np.ndarray
    group_of: np.ndarray  # per entry and group (entry-major): the group, ...
    row_of: np.ndarray  # ... the row ...
    lengths: np.ndarray  # ... and its number of blocks after the message


def _plan_tables(
    message: executor_pb2.StepRequest | executor_pb2.AllocateRequest,
    entries: Entries,
    rows: Rows,
    limits: Limits,
) -> _Tables:
    """Checks ``block_table_starts`` and ``new_block_counts`` (one value per
    entry and group, entry-major): each start within the row's blocks, each
    new length within ``max_blocks_per_row``; then ``new_block_ids``."""
    num_entries, num_groups = entries.num_entries, rows.num_groups
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
    row_of = entries.rows[entry_of]
    current = np.where(entries.is_new[entry_of], 0, rows.num_blocks[group_of, row_of])
    bad = starts > current
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"block_table_starts[{i}]: {starts[i]} > the row's {current[i]} blocks"
        )
    lengths = starts + counts
    max_blocks = rows.max_blocks_per_row
    bad = lengths > max_blocks
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"new_block_counts[{i}]: the row would hold {lengths[i]} blocks > {max_blocks}"
        )
    if not len(block_ids):  # no table changes (most decode steps)
        return _Tables(NO_IDS, NO_IDS, NO_IDS, block_ids, group_of, row_of, lengths)
    id_groups = np.repeat(group_of, counts)
    _check_new_block_ids(block_ids, id_groups, limits)
    id_offsets = np.arange(len(block_ids)) - np.repeat(np.cumsum(counts) - counts, counts)
    table_columns = np.repeat(starts, counts) + id_offsets
    table_rows = np.repeat(row_of, counts)
    return _Tables(id_groups, table_rows, table_columns, block_ids, group_of, row_of, lengths)


def _check_new_block_ids(block_ids: np.ndarray, id_groups: np.ndarray, limits: Limits) -> None:
    """Each new block id is below ``num_blocks``; the null block only in a
    sliding-window group (``id_groups``: each id's group)."""
    bad = block_ids >= limits.num_blocks
    if bad.any():
        i = first(bad)
        raise InvalidArgument(
            f"new_block_ids[{i}]: block {block_ids[i]} >= num_blocks {limits.num_blocks}"
        )
    windowed = np.asarray(limits.group_windowed, dtype=bool)
    bad = (block_ids == NULL_BLOCK_ID) & ~windowed[id_groups]
    if bad.any():
        i = first(bad)
        raise InvalidArgument(f"new_block_ids[{i}]: the null block 0 in a full-attention group")


def _check_coverage(tables: _Tables, ends: np.ndarray, num_groups: int, block_size: int) -> None:
    """Every group's table of every entry covers the entry's tokens up to ``ends``."""
    covered = tables.lengths.reshape(len(ends), num_groups) * block_size
    bad = covered < ends[:, None]
    if bad.any():
        e, g = np.argwhere(bad)[0]
        raise InvalidArgument(
            f"new_block_counts[{e * num_groups + g}]: {covered[e, g] // block_size} "
            f"blocks do not cover {ends[e]} tokens"
        )


def _step_plan(
    transfers: Transfers,
    untags: Sequence[BlockId],
    entries: Entries,
    tables: _Tables,
    copies: np.ndarray,
    columns: Columns,
    tokens: Tokens,
    tags: TagColumns,
) -> StepPlan:
    """The checked message as a plan. Host tokens: each new row's prompt,
    then every entry's needed tokens."""
    new_rows, needed, history = entries.new_rows, tokens.needed, tokens.history
    token_rows = [np.full(len(n.prompt), n.row, dtype=np.int64) for n in new_rows]
    token_positions = [np.arange(len(n.prompt), dtype=np.int64) for n in new_rows]
    token_rows.append(np.repeat(entries.rows, needed))
    token_positions.append(
        np.repeat(history, needed)
        + np.arange(needed.sum())
        - np.repeat(np.cumsum(needed) - needed, needed)
    )
    run = columns.scheduled > 0
    return StepPlan(
        offloads=transfers.offloads,
        loads=transfers.loads,
        untag_block_ids=untags,
        freed_rows=entries.freed.tolist(),
        new_rows=new_rows,
        table_groups=tables.groups,
        table_rows=tables.rows,
        table_columns=tables.columns,
        table_block_ids=tables.block_ids,
        table_lengths=np.stack([tables.group_of, tables.row_of, tables.lengths]),
        copies=copies,
        continue_rows=entries.rows[columns.cont],
        continue_positions=tokens.continue_positions,
        token_rows=np.concatenate(token_rows),
        token_positions=np.concatenate(token_positions),
        token_values=np.concatenate([*(n.prompt for n in new_rows), columns.tokens]),
        history_rows=entries.rows,
        history_lengths=np.maximum(history, tokens.ends),  # a window appends its samples
        rows=entries.rows[run],
        num_computed=columns.computed[run],
        num_scheduled=columns.scheduled[run],
        needs_sample=columns.sample[run],
        tags=tags,
        num_steps=tokens.num_steps,
    )
