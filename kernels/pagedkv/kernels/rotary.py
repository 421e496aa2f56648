"""Rotary position embedding fused with the KV cache write.

``rotary_and_cache`` rotates each token's query heads in place and writes its
rotated key and its value at its slot of the paged cache: one launch where
the unfused path takes transformers' rotary (about ten elementwise kernels
and two concatenations) and then ``reshape_and_cache``. The paged-attention
kernels read keys from the cache only, so the rotated key never needs to
exist outside it. Rotation as in Llama (``rotate_half``: dims ``d`` and
``d + head_size / 2`` form a pair), in float32, rounded once.

``cos_sin`` is ``[max_position, head_size]``: per position the cosines of the
first half's angles, then their sines (any scaling already applied), as the
model's rotary module computes them. Oracle: ``pagedkv.kernels.reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import check_rotary_args, check_rotate
from pagedkv.kernels.kv_quant import int8_scale, quantize, quantize_int8, scale_args


@triton.jit
def _rotate(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def walsh_hadamard(x, ROWS: tl.constexpr, WIDTH: tl.constexpr, LEVELS: tl.constexpr):
    """Each row of ``x`` (float32 ``[ROWS, WIDTH]``, ``WIDTH = 2 **
    LEVELS``) times the +-1 Hadamard matrix of order ``WIDTH`` (entry ``i,
    j`` negative when ``i & j`` has an odd number of bits), unscaled: the
    fast transform's butterflies, the widest stride first, each a sum and a
    difference of element pairs (a few hundred instructions, no matrix)."""
    for level in tl.static_range(LEVELS):
        pairs = tl.reshape(x, [ROWS, 1 << level, 2, WIDTH >> (level + 1)])
        first, second = tl.split(tl.permute(pairs, (0, 1, 3, 2)))
        joined = tl.join(first + second, first - second)
        x = tl.reshape(tl.permute(joined, (0, 1, 3, 2)), [ROWS, WIDTH])
    return x


@triton.jit
def hadamard(x, ROWS: tl.constexpr, WIDTH: tl.constexpr, LEVELS: tl.constexpr):
    """``x`` (float32 ``[ROWS, WIDTH]``) times the orthonormal Hadamard
    matrix of order ``WIDTH = 2 ** LEVELS`` (``fp8_kv.hadamard``)."""
    return walsh_hadamard(x, ROWS, WIDTH, LEVELS) * _hadamard_scale(WIDTH)


@triton.jit
def _hadamard_scale(WIDTH: tl.constexpr):
    """``1 / sqrt(WIDTH)``: the orthonormal matrix's entries, up to sign."""
    return 1.0 / tl.sqrt(WIDTH * 1.0)


@triton.jit
def _hadamard_half(x1, x2, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr, LEVELS: tl.constexpr):
    """``[x1, x2]`` times the orthonormal Hadamard matrix of order ``2 *
    BLOCK_HALF`` (``hadamard`` of the joined rows, the same operations in
    the same order), as its two halves: ``[(x1 + x2) S, (x1 - x2) S] /
    sqrt(2 * BLOCK_HALF)``, ``S`` the +-1 matrix of order ``BLOCK_HALF =
    2 ** LEVELS``. ``x1`` and ``x2``: float32 ``[ROWS, BLOCK_HALF]``."""
    norm = _hadamard_scale(2 * BLOCK_HALF)
    y1 = walsh_hadamard(x1 + x2, ROWS, BLOCK_HALF, LEVELS) * norm
    y2 = walsh_hadamard(x1 - x2, ROWS, BLOCK_HALF, LEVELS) * norm
    return y1, y2


@triton.jit
def _int8_halves(x1, x2, scale_ptr, scale_dst, scale_mask):
    """Each row of ``[x1, x2]`` (float32 halves of KV heads) quantized for
    an int8 cache with the row's own scale, which is stored at
    ``scale_ptr + scale_dst`` (``kv_quant``)."""
    scales = int8_scale(tl.maximum(tl.abs(x1), tl.abs(x2)), 1)
    tl.store(scale_ptr + scale_dst, scales, mask=scale_mask)
    divisor = scales.to(tl.float32)[:, None]
    return quantize_int8(x1, divisor), quantize_int8(x2, divisor)


@triton.jit
def _rotary_and_cache_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_size], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_ptr,  # [max_position, head_size]: cos of each pair's angle, then sin
    positions_ptr,  # [num_tokens]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens]
    k_scale_ptr,  # FP8: [1] or [num_kv_heads], float32; INT8: per token (kv_quant)
    v_scale_ptr,
    scale_stride,
    scale_stride_b,
    scale_stride_s,
    query_stride_t,
    query_stride_h,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_size,
    num_q_heads,
    num_kv_heads,
    half,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INT8: tl.constexpr,
    ROTATE: tl.constexpr,  # then times the Hadamard matrix (BLOCK_HALF is half the head)
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    LEVELS: tl.constexpr,  # ROTATE: BLOCK_HALF == 2 ** LEVELS
):
    token = tl.program_id(0).to(tl.int64)
    dtype = query_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dims_mask = dims < half
    position = tl.load(positions_ptr + token).to(tl.int64)
    angles = cos_sin_ptr + position * 2 * half + dims
    cos = tl.load(angles, mask=dims_mask, other=0.0).to(tl.float32)
    sin = tl.load(angles + half, mask=dims_mask, other=0.0).to(tl.float32)

    q_heads = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = (q_heads < num_q_heads) & dims_mask
    q_ptrs = query_ptr + token * query_stride_t + q_heads * query_stride_h + dims
    q1 = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptrs + half, mask=q_mask, other=0.0).to(tl.float32)
    q1, q2 = _rotate(q1, q2, cos, sin)
    if ROTATE:
        q1, q2 = _hadamard_half(q1, q2, BLOCK_HQ, BLOCK_HALF, LEVELS)
    tl.store(q_ptrs, q1.to(dtype), mask=q_mask)
    tl.store(q_ptrs + half, q2.to(dtype), mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    kv_heads = tl.arange(0, BLOCK_HKV)[:, None]
    kv_mask = valid & (kv_heads < num_kv_heads) & dims_mask
    dst = (
        (slot // block_size) * cache_stride_b
        + (slot % block_size) * cache_stride_s
        + kv_heads * cache_stride_h
        + dims
    )
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        head_valid = kv_heads < num_kv_heads
        k_scale = tl.load(k_scale_ptr + kv_heads * scale_stride, mask=head_valid, other=1.0)
        v_scale = tl.load(v_scale_ptr + kv_heads * scale_stride, mask=head_valid, other=1.0)
    cache_dtype = key_cache_ptr.dtype.element_ty
    k_ptrs = key_ptr + token * key_stride_t + kv_heads * key_stride_h + dims
    k1 = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptrs + half, mask=kv_mask, other=0.0).to(tl.float32)
    k1, k2 = _rotate(k1, k2, cos, sin)
    if ROTATE:
        k1, k2 = _hadamard_half(k1, k2, BLOCK_HKV, BLOCK_HALF, LEVELS)
    k1 = k1.to(dtype)
    k2 = k2.to(dtype)
    v_ptrs = value_ptr + token * value_stride_t + kv_heads * value_stride_h + dims
    v1 = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    v2 = tl.load(v_ptrs + half, mask=kv_mask, other=0.0)
    if INT8:
        heads = tl.arange(0, BLOCK_HKV)
        scale_dst = (
            (slot // block_size) * scale_stride_b
            + (slot % block_size) * scale_stride_s
            + heads * scale_stride
        )
        scale_mask = valid & (heads < num_kv_heads)
        k1, k2 = _int8_halves(
            k1.to(tl.float32), k2.to(tl.float32), k_scale_ptr, scale_dst, scale_mask
        )
        v1, v2 = _int8_halves(
            v1.to(tl.float32), v2.to(tl.float32), v_scale_ptr, scale_dst, scale_mask
        )
    k1 = quantize(k1, k_scale, FP8, FP8_MAX).to(cache_dtype)
    k2 = quantize(k2, k_scale, FP8, FP8_MAX).to(cache_dtype)
    tl.store(key_cache_ptr + dst, k1, mask=kv_mask)
    tl.store(key_cache_ptr + dst + half, k2, mask=kv_mask)
    v1 = quantize(v1, v_scale, FP8, FP8_MAX).to(cache_dtype)
    v2 = quantize(v2, v_scale, FP8, FP8_MAX).to(cache_dtype)
    tl.store(value_cache_ptr + dst, v1, mask=kv_mask)
    tl.store(value_cache_ptr + dst + half, v2, mask=kv_mask)


def rotary_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rotate: bool = False,
) -> None:
    """Rotates ``query`` in place; writes the rotated key (rounded to the
    query's dtype, then quantized for an fp8 cache) and the value of each
    token at its slot (negative slots are skipped; an int8 cache's scales
    written at the same slots). ``positions`` must be
    below ``len(cos_sin)`` (not checked: that would wait for the device).

    With ``rotate`` (a head size that is a power of two, at least 32) the
    rotated query and key are then multiplied by the orthonormal Hadamard
    matrix of the head size (``fp8_kv.hadamard``), in float32, before either
    is rounded: every score is unchanged, and the key is stored in that
    basis, where a few large channels are spread over all of them (what fp8
    rounding needs; docs/memory.md, "fp8 blocks"). The value is stored as
    given (a caller puts it in that basis through its projection's weights)."""
    check_rotary_args(query, key, value, cos_sin, positions, key_cache, value_cache, slot_mapping)
    check_rotate(rotate, query.shape[-1])
    scales = scale_args(key_cache, k_scale, v_scale, slot_mapping)
    num_tokens, num_q_heads, head_size = query.shape
    if not num_tokens:
        return
    num_kv_heads = key.shape[1]
    _rotary_and_cache_kernel[(num_tokens,)](
        query,
        key,
        value,
        cos_sin,
        positions,
        key_cache,
        value_cache,
        slot_mapping,
        scales.k_scale,
        scales.v_scale,
        scales.stride,
        scales.stride_b,
        scales.stride_s,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[1],
        num_q_heads,
        num_kv_heads,
        head_size // 2,
        FP8=scales.fp8,
        FP8_MAX=scales.fp8_max,
        INT8=scales.int8,
        ROTATE=rotate,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_size // 2),
        LEVELS=(head_size // 2).bit_length() - 1,
        num_warps=4,
    )
