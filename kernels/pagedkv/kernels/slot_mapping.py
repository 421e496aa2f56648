"""Triton kernel: the KV slot of every packed token. Oracle: ``reference.compute_slot_mapping``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import check_int_vector


@triton.jit
def _slot_mapping_kernel(
    query_start_loc_ptr,  # [num_seqs + 1]
    positions_ptr,  # [num_tokens]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    slots_ptr,  # [num_tokens], out
    block_table_stride,
    block_size,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    tokens = start + tile * BLOCK + tl.arange(0, BLOCK)
    mask = tokens < end
    positions = tl.load(positions_ptr + tokens, mask=mask, other=0).to(tl.int64)
    blocks = tl.load(
        block_table_ptr + seq * block_table_stride + positions // block_size, mask=mask, other=0
    ).to(tl.int64)
    tl.store(slots_ptr + tokens, blocks * block_size + positions % block_size, mask=mask)


def compute_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """The slot of every packed token (int64): its sequence's block at ``position // block_size``.

    ``max_query_len`` (the longest sequence's new tokens) sizes the launch;
    it is computed, with a device sync, when not given.
    """
    check_int_vector("query_start_loc", query_start_loc)
    check_int_vector("positions", positions)
    if block_table.ndim != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_table: expected an int [num_seqs, max_blocks_per_seq] tensor")
    if block_table.stride(1) != 1:
        raise ValueError("block_table: rows must be contiguous")
    num_seqs = len(query_start_loc) - 1
    if block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table: {block_table.shape[0]} rows for {num_seqs} sequences")
    slots = torch.empty(len(positions), dtype=torch.int64, device=positions.device)
    if not len(positions) or num_seqs <= 0:
        return slots
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max())
    block = min(1024, triton.next_power_of_2(max(max_query_len, 1)))
    grid = (num_seqs, triton.cdiv(max_query_len, block))
    _slot_mapping_kernel[grid](
        query_start_loc,
        positions,
        block_table,
        slots,
        block_table.stride(0),
        block_size,
        BLOCK=block,
    )
    return slots
