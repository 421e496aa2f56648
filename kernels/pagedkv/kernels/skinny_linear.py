"""A Triton linear layer for the few rows of a decode step: ``x @ weight.T``
with ``weight`` ``[out_features, in_features]`` as transformers stores it.

At decode batch sizes (tens to a few hundred rows) a projection reads its
whole weight for little arithmetic, so its time is the weight's bytes over
the memory bandwidth; the tile is narrow along the rows (one tile holds
every row up to ``block_m``) and wide along the input features, so that the
launch has programs enough to stream the weight from every multiprocessor.
With ``split_k`` > 1 the input features are split among that many programs
per tile, each writing a float32 partial sum (``[split_k, num_rows,
out_features]``), which ``sum_splits`` adds up in a fixed order (so results
do not depend on scheduling) and rounds; a consumer kernel of our own could
read the partials instead, saving that launch.
Accumulates in float32 and rounds once to the output dtype. Oracle:
``x @ weight.T`` in float32. Its speed against cuBLAS is measured by
``python -m pagedkv.bench.kernels.bench_gemm``.
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
    split_k: int = 1


@triton.jit
def _skinny_linear_kernel(
    x_ptr,  # [num_rows, in_features]
    w_ptr,  # [out_features, in_features]
    out_ptr,  # [num_rows, out_features], or float32 [split_k, num_rows, out_features]
    num_rows,
    out_features,
    in_features,
    x_stride,
    w_stride,
    out_stride,
    split_stride,  # between one split's partial sums and the next (0: one split)
    split_size,  # input features per split, a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2).to(tl.int64)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    row_ok = rows < num_rows
    col_ok = cols < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * split_size
    last = tl.minimum(first + split_size, in_features)
    for start in range(first, last, BLOCK_K):
        k = start + ks
        k_ok = k < last
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
        out_ptr + split * split_stride + rows[:, None] * out_stride + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _sum_splits_kernel(
    partial_ptr,  # float32 [num_splits, num_values]
    out_ptr,  # [num_values]
    num_values,
    num_splits,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < num_values
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(0, num_splits):
        total += tl.load(partial_ptr + split * num_values + offsets, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile) -> None:
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x {x.dtype} and weight {weight.dtype}: one float dtype")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if tile.split_k < 1:
        raise ValueError(f"split_k: {tile.split_k} < 1")


def skinny_linear_partials(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile) -> torch.Tensor:
    """The ``tile.split_k`` float32 partial sums of ``x @ weight.T``, a new
    ``[split_k, num_rows, out_features]`` tensor (arguments as ``skinny_linear``)."""
    _check(x, weight, tile)
    out = torch.empty(
        (tile.split_k, x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device
    )
    _launch(x, weight, out, tile)
    return out


def sum_splits(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``partials`` (float32 ``[splits, ...]``, contiguous) summed over the
    first dim in order, rounded to ``dtype``."""
    out = torch.empty(partials.shape[1:], dtype=dtype, device=partials.device)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(out.numel(), block),)](
        partials, out, out.numel(), partials.shape[0], BLOCK=block
    )
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile) -> torch.Tensor:
    """``x @ weight.T`` (``x`` ``[num_rows, in_features]``, ``weight``
    ``[out_features, in_features]``, both of one float dtype, the last dim
    contiguous) under ``tile``; a new ``[num_rows, out_features]`` tensor."""
    if tile.split_k > 1:
        return sum_splits(skinny_linear_partials(x, weight, tile), x.dtype)
    _check(x, weight, tile)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, weight, out, tile)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tile: LinearTile) -> None:
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    # Each split takes whole steps of block_k input features.
    split_size = triton.cdiv(triton.cdiv(in_features, tile.split_k), tile.block_k) * tile.block_k
    splits = triton.cdiv(in_features, split_size)
    if splits < tile.split_k:  # fewer steps than splits: the last ones sum nothing
        out[splits:].zero_()
    grid = (
        triton.cdiv(out_features, tile.block_n),
        triton.cdiv(num_rows, tile.block_m),
        splits,
    )
    _skinny_linear_kernel[grid](
        x,
        weight,
        out,
        num_rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        out.stride(-2),
        out.stride(0) if out.ndim == 3 else 0,
        split_size,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
