"""Flash-decoding's second pass: the splits of each (sequence, query head)
merged by their log-sum-exp (``decode_attention`` writes them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.attend import MASKED

# The merge kernel's load per program: about DECODE_MERGE_ELEMENTS partial
# values (splits x dims), at least DECODE_MERGE_MIN_DIMS dims: a long split
# list is spread over more programs, a short one kept whole (on the H200,
# 32-dim slices were the fastest with tens of splits, whole heads with two).
DECODE_MERGE_ELEMENTS = 4096
DECODE_MERGE_MIN_DIMS = 32


@triton.jit
def _decode_merge_kernel(
    partial_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_size], float32
    partial_lse_ptr,  # [num_seqs, num_q_heads, num_splits], float32
    out_ptr,  # [num_seqs, num_q_heads, head_size]
    out_stride_t,
    out_stride_h,
    num_q_heads,
    num_splits,
    head_size,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Flash-decoding, second pass: one program per (sequence, query head,
    ``BLOCK_D`` dims) weighs its splits' outputs by their sums, all
    ``num_splits <= BLOCK_S`` splits in one load."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    row = (seq * num_q_heads + head) * num_splits
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < num_splits
    lse = tl.load(partial_lse_ptr + row + splits, mask=split_valid, other=MASKED)
    weights = tl.exp2(lse - tl.max(lse, 0))  # 0 for empty splits
    parts = tl.load(
        partial_out_ptr + (row + splits)[:, None] * head_size + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + seq * out_stride_t + head * out_stride_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def merge_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    block_d: int,
) -> None:
    """Writes ``out`` ``[num_seqs, num_q_heads, head_size]`` from the
    splits' partial outputs (float32, ``[num_seqs, num_q_heads, num_splits,
    head_size]`` flattened) and base-2 log-sum-exps; ``block_d``: the head
    size padded to a power of two."""
    num_seqs, num_q_heads, head_size = out.shape
    block_s = triton.next_power_of_2(num_splits)
    merge_dims = min(block_d, max(DECODE_MERGE_MIN_DIMS, DECODE_MERGE_ELEMENTS // block_s))
    _decode_merge_kernel[(num_seqs, num_q_heads, triton.cdiv(head_size, merge_dims))](
        partial_out,
        partial_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_q_heads,
        num_splits,
        head_size,
        BLOCK_S=block_s,
        BLOCK_D=merge_dims,
    )
