"""A decode step's forward inputs in one launch: for each entry (a row and
the position of its new token, negative for padding), the input token read
from the rows' histories, the clamped position, the sequence length, each
KV group's block-table row gathered for the entry and the token's slot in
each group (-1 for padding). In torch that is eight or more small kernels
(the table gathers, the slot mapping, the padding mask, the token gather,
the clamp and casts); a CUDA graph's decode forward runs it first. Oracle:
``pagedkv.kernels.reference.decode_inputs``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.backend import DecodeInputs


@triton.jit
def _decode_inputs_kernel(
    rows_ptr,  # int64 [num_entries]
    raw_positions_ptr,  # int64 [num_entries]: negative for padding
    token_ids_ptr,  # int64 [max_rows, max_len]
    tables_ptr,  # int32 [num_groups, max_rows, max_columns]
    input_ids_ptr,
    positions_ptr,
    seq_lens_ptr,
    out_tables_ptr,  # int32 [num_groups, num_entries, num_columns]
    slots_ptr,  # int64 [num_groups, num_entries]
    token_stride,
    tables_stride_g,
    tables_stride_r,
    num_entries,
    num_columns,
    block_size,
    NUM_GROUPS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + entry).to(tl.int64)
    raw = tl.load(raw_positions_ptr + entry).to(tl.int64)
    position = tl.maximum(raw, 0)
    tl.store(input_ids_ptr + entry, tl.load(token_ids_ptr + row * token_stride + position))
    tl.store(positions_ptr + entry, position)
    tl.store(seq_lens_ptr + entry, (position + 1).to(tl.int32))
    columns = tl.arange(0, BLOCK_C).to(tl.int64)
    for group in tl.static_range(NUM_GROUPS):
        src = tables_ptr + group * tables_stride_g + row * tables_stride_r
        dst = out_tables_ptr + (group * num_entries + entry) * num_columns
        for start in range(0, num_columns, BLOCK_C):
            c = start + columns
            keep = c < num_columns
            tl.store(dst + c, tl.load(src + c, mask=keep, other=0), mask=keep)
        block = tl.load(src + position // block_size).to(tl.int64)
        slot = tl.where(raw < 0, -1, block * block_size + position % block_size)
        tl.store(slots_ptr + group * num_entries + entry, slot)


def decode_inputs(
    rows: torch.Tensor,
    raw_positions: torch.Tensor,
    token_ids: torch.Tensor,
    block_tables: torch.Tensor,
    num_columns: int,
    block_size: int,
) -> DecodeInputs:
    """The inputs of one-token decodes of ``rows`` at ``raw_positions``
    (negative: a padding entry, read at position 0 and writing no K/V), from
    the histories ``token_ids`` ``[max_rows, max_len]`` and the tables
    ``block_tables`` ``[num_groups, max_rows, max_columns]`` (their first
    ``num_columns`` columns). Indices are not checked (that would wait for
    the device): every row below ``max_rows``, every position's block
    within ``num_columns``."""
    num_groups = block_tables.shape[0]
    num_entries = len(rows)
    device = rows.device
    out = DecodeInputs(
        input_ids=torch.empty(num_entries, dtype=torch.int64, device=device),
        positions=torch.empty(num_entries, dtype=torch.int64, device=device),
        seq_lens=torch.empty(num_entries, dtype=torch.int32, device=device),
        block_tables=torch.empty(
            (num_groups, num_entries, num_columns), dtype=torch.int32, device=device
        ),
        slot_mappings=torch.empty((num_groups, num_entries), dtype=torch.int64, device=device),
    )
    if num_entries:
        _decode_inputs_kernel[(num_entries,)](
            rows,
            raw_positions,
            token_ids,
            block_tables,
            *out,
            token_ids.stride(0),
            block_tables.stride(0),
            block_tables.stride(1),
            num_entries,
            num_columns,
            block_size,
            NUM_GROUPS=num_groups,
            BLOCK_C=min(256, triton.next_power_of_2(max(num_columns, 16))),
        )
    return out
