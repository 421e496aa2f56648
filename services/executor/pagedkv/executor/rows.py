"""The executor's live requests, one block-table row each.

Host side (numpy and lists): which rows are live, their sequence ids and
sampling params, how many tokens each row's history holds, how many blocks
each group's row holds, a copy of the block tables, and whether the row has
a sample not yet appended.
Device side: the block tables, the token histories and the last sampled token
of every row, so that a step never waits for the host to learn a sample
(async stepping appends it on the device).

Only ``Rows`` methods mutate this state: ``apply`` makes a validated
``StepPlan``'s changes (see step_plan.py; the engine calls it), and
``record_samples`` keeps a forward's samples (the model runner calls it).
The forward's inputs read the device side (forward_inputs.py). Scratch
tables for warm-up forwards, benchmarks and tests go through
``fill_tables`` and ``clear_tables``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pagedkv.common.ids import BlockId
from pagedkv.executor.step_types import RowSampling, StepPlan


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without waiting for the device: through
    pinned memory on CUDA (a copy from pageable memory would first wait for
    the stream to drain, so the host could never run ahead)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class Rows:
    """``max_num_rows`` rows over ``num_groups`` block tables on ``device``."""

    def __init__(
        self,
        num_groups: int,
        max_num_rows: int,
        max_blocks_per_row: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.num_groups = num_groups
        self.max_num_rows = max_num_rows
        self.max_blocks_per_row = max_blocks_per_row
        self.max_model_len = max_model_len
        self.device = device
        self.live = np.zeros(max_num_rows, dtype=bool)
        # Bumped whenever a row's sampling params change (add, free): a
        # batch of params built for some rows stays valid while it holds.
        self.sampling_version = 0
        self.seq_ids: list[str | None] = [None] * max_num_rows
        self.row_of_seq: dict[str, int] = {}
        self.sampling: list[RowSampling | None] = [None] * max_num_rows
        self.num_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.num_blocks = np.zeros((num_groups, max_num_rows), dtype=np.int64)
        self.pending_sample = np.zeros(max_num_rows, dtype=bool)
        self.block_tables = torch.zeros(
            (num_groups, max_num_rows, max_blocks_per_row), dtype=torch.int32, device=device
        )
        # The tables' host copy, read when rows are freed (released_blocks)
        # without waiting for the device.
        self.host_tables = np.zeros((num_groups, max_num_rows, max_blocks_per_row), dtype=np.int32)
        self.token_ids = torch.zeros(
            (max_num_rows, max_model_len), dtype=torch.int64, device=device
        )
        self.last_sampled = torch.zeros(max_num_rows, dtype=torch.int64, device=device)

    def apply(self, plan: StepPlan) -> None:
        """A validated step's (or allocation's) changes, in order: freed rows,
        new rows, table changes, last samples appended and host tokens
        written (those rows' samples are no longer pending), history
        lengths."""
        self.free(plan.freed_rows)
        for new in plan.new_rows:
            self.add(new.row, new.seq_id, new.sampling)
        self.set_tables(
            plan.table_groups,
            plan.table_rows,
            plan.table_columns,
            plan.table_block_ids,
            plan.table_lengths,
        )
        self.append_samples(plan.continue_rows, plan.continue_positions)
        self.write_tokens(plan.token_rows, plan.token_positions, plan.token_values)
        self.pending_sample[plan.continue_rows] = False
        self.pending_sample[np.unique(plan.token_rows)] = False
        self.num_tokens[plan.history_rows] = plan.history_lengths

    def record_samples(
        self, rows: np.ndarray, device_rows: torch.Tensor, token_ids: torch.Tensor
    ) -> None:
        """A forward's samples: ``token_ids`` become the last samples of
        ``rows`` (``device_rows`` is the same rows on the device), pending
        until a step appends them."""
        self.last_sampled[device_rows] = token_ids
        self.pending_sample[rows] = True

    def fill_tables(self, block_ids: np.ndarray) -> None:
        """Rows ``0 .. n - 1`` of every group hold ``block_ids`` (``[n,
        num_blocks]``) from their first column: scratch tables for warm-up
        forwards, benchmarks and tests."""
        num_rows, num_blocks = block_ids.shape
        ids = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int32))
        self.block_tables[:, :num_rows, :num_blocks] = ids.to(self.device)
        self.host_tables[:, :num_rows, :num_blocks] = block_ids
        self.num_blocks[:, :num_rows] = num_blocks

    def clear_tables(self) -> None:
        """Every table empty (after scratch tables)."""
        self.block_tables.zero_()
        self.host_tables[:] = 0
        self.num_blocks[:] = 0

    def set_num_tokens(self, rows: np.ndarray, num_tokens: np.ndarray | int) -> None:
        """Sets the rows' history lengths (a benchmark rewinds them to time
        steps at one context)."""
        self.num_tokens[rows] = num_tokens

    def released_blocks(self, rows: Iterable[int]) -> list[BlockId]:
        """The blocks the rows' tables hold, in the order a scheduler releases
        them when it frees those rows: row by row, each group's table from its
        last block to its first (a prefix's head is released last, so it is
        evicted last). Read before ``free``."""
        released: list[BlockId] = []
        for row in rows:
            for group in range(self.num_groups):
                num_blocks = int(self.num_blocks[group, row])
                if num_blocks:
                    released.extend(self.host_tables[group, row, num_blocks - 1 :: -1].tolist())
        return released

    def free(self, rows: list[int]) -> None:
        """Forgets the rows (live or not): tables, histories and pending samples."""
        if not len(rows):
            return
        self.sampling_version += 1
        for row in rows:
            seq_id = self.seq_ids[row]
            if seq_id is not None:
                del self.row_of_seq[seq_id]
            self.seq_ids[row] = None
            self.sampling[row] = None
        self.live[rows] = False
        self.num_tokens[rows] = 0
        self.num_blocks[:, rows] = 0
        self.pending_sample[rows] = False

    def free_all(self) -> list[int]:
        """Frees every live row; returns them, ascending."""
        rows = np.flatnonzero(self.live).tolist()
        self.free(rows)
        return rows

    def add(self, row: int, seq_id: str, sampling: RowSampling) -> None:
        """Makes ``row`` live with an empty history (the caller writes its
        prompt with ``write_tokens``)."""
        self.sampling_version += 1
        self.live[row] = True
        self.seq_ids[row] = seq_id
        self.row_of_seq[seq_id] = row
        self.sampling[row] = sampling
        self.num_tokens[row] = 0
        self.num_blocks[:, row] = 0
        self.pending_sample[row] = False

    def set_tables(
        self,
        groups: np.ndarray,
        rows: np.ndarray,
        columns: np.ndarray,
        block_ids: np.ndarray,
        new_lengths: np.ndarray,
    ) -> None:
        """Writes ``block_ids`` at (group, row, column) and sets each (group,
        row)'s length; ``new_lengths`` is ``[3, n]``: group, row, length."""
        if len(block_ids):
            index = to_device(np.stack([groups, rows, columns, block_ids]), self.device)
            self.block_tables[index[0], index[1], index[2]] = index[3].to(torch.int32)
            self.host_tables[groups, rows, columns] = block_ids
        self.num_blocks[new_lengths[0], new_lengths[1]] = new_lengths[2]

    def write_tokens(self, rows: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> None:
        """Writes host tokens into the histories (positions already validated)."""
        if len(token_ids):
            index = to_device(np.stack([rows, positions, token_ids]).astype(np.int64), self.device)
            self.token_ids[index[0], index[1]] = index[2]

    def append_samples(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """Writes each row's last sample at its position, on the device (the
        caller sets the history lengths)."""
        if len(rows):
            index = to_device(np.stack([rows, positions]), self.device)
            self.token_ids[index[0], index[1]] = self.last_sampled[index[0]]

    def append_samples_on_device(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """As ``append_samples``, with the rows and positions already on the device."""
        self.token_ids[rows, positions] = self.last_sampled[rows]
