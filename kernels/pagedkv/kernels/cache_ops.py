"""Triton kernels that move K/V into and within the paged cache.

``reshape_and_cache`` writes a step's new K/V at their slots; ``copy_blocks``
runs copy-on-write copies; ``gather_blocks`` and ``scatter_blocks`` move
whole blocks of every layer between the caches and rows of a host tier's
layout, in one launch. Oracles: ``pagedkv.kernels.reference``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import (
    check_block_rows,
    check_block_storage,
    check_cache,
    check_int_vector,
    check_kv_input,
)
from pagedkv.kernels.kv_quant import int8_scale, quantize, quantize_int8, scale_args


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens]
    k_scale_ptr,  # FP8: [1] or [num_kv_heads], float32; INT8: per token (kv_quant)
    v_scale_ptr,
    scale_stride,
    scale_stride_b,
    scale_stride_s,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_size,
    num_kv_heads,
    head_size,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INT8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = valid & (heads < num_kv_heads) & (dims < head_size)
    key = tl.load(
        key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask, other=0.0
    )
    value = tl.load(
        value_ptr + token * value_stride_t + heads * value_stride_h + dims, mask=mask, other=0.0
    )
    if INT8:  # each head's own scale, stored beside its values
        key = key.to(tl.float32)
        value = value.to(tl.float32)
        k_token_scales = int8_scale(key, 1)
        v_token_scales = int8_scale(value, 1)
        key = quantize_int8(key, k_token_scales.to(tl.float32)[:, None])
        value = quantize_int8(value, v_token_scales.to(tl.float32)[:, None])
        token_heads = tl.arange(0, BLOCK_H)
        scale_dst = block * scale_stride_b + offset * scale_stride_s + token_heads * scale_stride
        head_mask = valid & (token_heads < num_kv_heads)
        tl.store(k_scale_ptr + scale_dst, k_token_scales, mask=head_mask)
        tl.store(v_scale_ptr + scale_dst, v_token_scales, mask=head_mask)
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr + heads * scale_stride, mask=heads < num_kv_heads, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads * scale_stride, mask=heads < num_kv_heads, other=1.0)
    key = quantize(key, k_scale, FP8, FP8_MAX).to(key_cache_ptr.dtype.element_ty)
    value = quantize(value, v_scale, FP8, FP8_MAX).to(value_cache_ptr.dtype.element_ty)
    dst = block * cache_stride_b + offset * cache_stride_s + heads * cache_stride_h + dims
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes each token's K and V at its slot; negative slots are skipped.
    An fp8 cache stores them quantized with ``k_scale`` / ``v_scale``
    (``fp8_kv.quantize``); an int8 cache stores them quantized with their
    own scales, written into ``k_scale`` / ``v_scale`` at the same slots
    (``int8_kv``)."""
    check_cache("key_cache", key_cache)
    check_cache("value_cache", value_cache, like=key_cache)
    num_tokens, num_kv_heads, head_size = key.shape
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key: {tuple(key.shape)} does not match the cache {tuple(key_cache.shape)}"
        )
    check_kv_input("key", key, key_cache)
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError("value: must match key in shape and dtype")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key, value: the last dimension must be contiguous")
    check_int_vector("slot_mapping", slot_mapping, num_tokens)
    scales = scale_args(key_cache, k_scale, v_scale, slot_mapping)
    if not num_tokens:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        scales.k_scale,
        scales.v_scale,
        scales.stride,
        scales.stride_b,
        scales.stride_s,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[1],
        num_kv_heads,
        head_size,
        FP8=scales.fp8,
        FP8_MAX=scales.fp8_max,
        INT8=scales.int8,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # [num_blocks, block_numel] (one layer's K or V, flattened per block)
    src_dst_ptr,  # [num_copies, 2]
    block_numel,
    BLOCK: tl.constexpr,
):
    copy = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    src = tl.load(src_dst_ptr + 2 * copy).to(tl.int64)
    dst = tl.load(src_dst_ptr + 2 * copy + 1).to(tl.int64)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < block_numel
    data = tl.load(cache_ptr + src * block_numel + offsets, mask=mask)
    tl.store(cache_ptr + dst * block_numel + offsets, data, mask=mask)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_dst: torch.Tensor,
) -> None:
    """Copies block ``src`` into block ``dst`` in every layer, K and V: each
    a contiguous ``[num_blocks, ...]`` tensor (a cache, or the storage that
    holds an int8 cache's values and scales, kv_memory.py)."""
    if (
        src_dst.ndim != 2
        or src_dst.shape[1] != 2
        or src_dst.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"src_dst: expected an int [num_copies, 2] tensor, got {tuple(src_dst.shape)}"
        )
    if not len(src_dst):
        return
    src_dst = src_dst.contiguous()
    for i, cache in enumerate((*key_caches, *value_caches)):
        check_block_storage(f"caches[{i}]", cache)
        block_numel = cache[0].numel()
        block = min(4096, triton.next_power_of_2(block_numel))
        grid = (len(src_dst), triton.cdiv(block_numel, block))
        _copy_blocks_kernel[grid](cache, src_dst, block_numel, BLOCK=block)


@triton.jit
def _block_rows_kernel(
    first_ptr,  # caches[0]; every cache is reached from it by its offset
    offsets_ptr,  # [num_caches] int64: each cache's start, in elements from caches[0]'s
    block_ids_ptr,  # [n]
    rows_ptr,  # [n, num_caches * block_numel]
    block_numel,
    num_caches,
    TO_ROWS: tl.constexpr,  # gather (blocks to rows), else scatter
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    chunk = tl.program_id(2)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    start = tl.load(offsets_ptr + part)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offsets < block_numel
    cache = first_ptr + start + block * block_numel + offsets
    row = rows_ptr + (i * num_caches + part) * block_numel + offsets
    if TO_ROWS:
        tl.store(row, tl.load(cache, mask=mask), mask=mask)
    else:
        tl.store(cache, tl.load(row, mask=mask), mask=mask)


_OFFSETS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _cache_offsets(device: torch.device, pointers: tuple[int, ...], size: int) -> torch.Tensor:
    """Each cache's start in elements from the first's, on ``device``; made
    once per set of caches (a copy from host memory each call would wait
    for the device)."""
    key = (device, pointers)
    offsets = _OFFSETS.get(key)
    if offsets is None:
        starts = [pointer - pointers[0] for pointer in pointers]
        assert all(start % size == 0 for start in starts)
        offsets = torch.tensor([start // size for start in starts], dtype=torch.int64)
        _OFFSETS[key] = offsets = offsets.to(device)
    return offsets


def _block_rows(
    name: str,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    rows: torch.Tensor,
    to_rows: bool,
) -> None:
    """One launch over every cache: each reached from ``caches[0]`` by its
    offset in elements (the caches are separate allocations of one dtype,
    so the offsets are whole)."""
    block_numel = check_block_rows(name, caches, block_ids, rows)
    if not len(block_ids):
        return
    first = caches[0]
    pointers = tuple(cache.data_ptr() for cache in caches)
    offsets = _cache_offsets(first.device, pointers, first.element_size())
    block = min(4096, triton.next_power_of_2(block_numel))
    grid = (len(block_ids), len(caches), triton.cdiv(block_numel, block))
    _block_rows_kernel[grid](
        first, offsets, block_ids, rows, block_numel, len(caches), TO_ROWS=to_rows, BLOCK=block
    )


def gather_blocks(
    caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor
) -> None:
    """Row ``i`` of ``out``: block ``block_ids[i]`` of each cache in turn
    (``reference.gather_blocks``), in one launch."""
    _block_rows("out", caches, block_ids, out, to_rows=True)


def scatter_blocks(
    caches: Sequence[torch.Tensor], block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """Row ``i`` of ``rows`` into block ``block_ids[i]`` of each cache
    (``reference.scatter_blocks``), in one launch; ``block_ids`` distinct."""
    _block_rows("rows", caches, block_ids, rows, to_rows=False)
