"""A Triton linear layer for the few rows of a decode step: ``x @ weight.T``
with ``weight`` ``[out_features, in_features]`` as transformers stores it.

At decode batch sizes (tens to a few hundred rows) a projection reads its
whole weight for little arithmetic, so its time is the weight's bytes over
the memory bandwidth; the tile is narrow along the rows (one tile holds
every row up to ``block_m``) and wide along the input features, so that the
launch has programs enough to stream the weight from every multiprocessor.
Accumulates in float32 and rounds once to the input dtype. Oracle:
``x @ weight.T`` in float32. Its speed against cuBLAS is measured by
``python -m pagedkv.kernels.bench_gemm``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import FLOAT_DTYPES


class LinearTile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_linear_kernel(
    x_ptr,  # [num_rows, in_features]
    w_ptr,  # [out_features, in_features]
    out_ptr,  # [num_rows, out_features]
    num_rows,
    out_features,
    in_features,
    x_stride,
    w_stride,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    row_ok = rows < num_rows
    col_ok = cols < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        k = start + ks
        k_ok = k < in_features
        x = tl.load(
            x_ptr + rows[:, None] * x_stride + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * w_stride + k[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(
        out_ptr + rows[:, None] * out_stride + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile) -> torch.Tensor:
    """``x @ weight.T`` (``x`` ``[num_rows, in_features]``, ``weight``
    ``[out_features, in_features]``, both of one float dtype, the last dim
    contiguous) under ``tile``; a new ``[num_rows, out_features]`` tensor."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x {x.dtype} and weight {weight.dtype}: one float dtype")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(out_features, tile.block_n), triton.cdiv(num_rows, tile.block_m))
    _skinny_linear_kernel[grid](
        x,
        weight,
        out,
        num_rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out
