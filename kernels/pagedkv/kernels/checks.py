"""Argument checks shared by the kernel launchers: clear errors naming the argument."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)


def check_cache(name: str, cache: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """A KV cache tensor: ``[num_blocks, block_size, num_kv_heads, head_size]``."""
    if cache.ndim != 4:
        raise ValueError(f"{name}: expected [num_blocks, block_size, num_kv_heads, head_size]")
    if cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype {cache.dtype} is not one of {FLOAT_DTYPES}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")
    if like is not None and (
        cache.shape != like.shape or cache.dtype != like.dtype or cache.stride() != like.stride()
    ):
        raise ValueError(f"{name}: must match the key cache in shape, dtype and strides")


def check_int_vector(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    """A contiguous 1-D int32/int64 tensor, of ``length`` elements when given."""
    if tensor.ndim != 1 or tensor.dtype not in INT_DTYPES or not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous 1-D int32/int64 tensor")
    if length is not None and len(tensor) != length:
        raise ValueError(f"{name}: {len(tensor)} entries, expected {length}")
