"""The flash-decoding program (``decode_attention`` launches it): one
program per (sequence, KV head, split of the context) reads each K/V byte
once for all the query heads that share it, after, with ``ROTARY``, writing
the new token's rotated key and value where its split holds them. Its
launch constants and the launcher live in ``decode_attention``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.kernels.attend import MASKED, attend_span
from pagedkv.kernels.kv_quant import int8_scale, quantize, quantize_int8
from pagedkv.kernels.rotary import hadamard


@triton.jit
def _decode_split_kernel(
    query_ptr,  # [num_seqs, num_q_heads, head_size] (one new token per sequence)
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    partial_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_size], float32
    partial_lse_ptr,  # [num_seqs, num_q_heads, num_splits], float32, base-2 log-sum-exp
    out_ptr,  # [num_seqs, num_q_heads, head_size]
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_table_stride,
    scale,
    softcap,
    sliding_window,
    head_size,
    num_q_heads,
    num_queries_per_kv,
    num_splits,
    key_ptr,  # ROTARY: [num_seqs, num_kv_heads, head_size], the new tokens' keys
    value_ptr,  # ROTARY: [num_seqs, num_kv_heads, head_size], their values
    cos_sin_ptr,  # ROTARY: [max_position, head_size], as rotary_and_cache reads it
    positions_ptr,  # ROTARY: [num_seqs]
    slot_mapping_ptr,  # ROTARY: [num_seqs], the new tokens' slots (negative: none)
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    k_scale_ptr,  # FP8: [1] or [num_kv_heads], float32; INT8: per token (kv_quant)
    v_scale_ptr,
    scale_stride,
    scale_stride_b,
    scale_stride_s,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    SPLIT: tl.constexpr,
    ROTARY: tl.constexpr,
    ROTATE: tl.constexpr,  # ROTARY: then the Hadamard basis (BLOCK_D == head_size == 2 ** LEVELS)
    LEVELS: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    WIDEN_V: tl.constexpr,
    PREFETCH: tl.constexpr,
    INT8: tl.constexpr,
    SCALE_TILES: tl.constexpr,  # attend's: INT8 tiles scaled, not their scores
    WORDS: tl.constexpr,  # attend's: V tiles read as 32-bit words
):
    """Flash-decoding: one (sequence, KV head, split of the context) per
    program; the query heads sharing the KV head are the rows, so each K/V
    byte is read once for all of them. With ``SPLIT`` each program stores its
    partial output and log-sum-exp for ``decode_merge``; without,
    there is one split and the program stores the output. With ``ROTARY``
    the query is rotated here (left as it is in memory), and the program
    whose split holds the new token rotates its key and writes it and its
    value at its slot before it reads the cache, as ``rotary_and_cache``
    would have (the same float32 rotation, rounded once to the query's
    dtype; with ``ROTATE`` times the Hadamard matrix before that rounding,
    as ``rotary_and_cache(rotate=True)``). An fp8 or int8 cache is written
    quantized and read through its scales."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr + kv_head * scale_stride)
        v_scale = tl.load(v_scale_ptr + kv_head * scale_stride)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    q_pos = seq_len - 1

    groups = tl.arange(0, BLOCK_G)
    group_valid = groups < num_queries_per_kv
    heads = kv_head * num_queries_per_kv + groups
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    q_ptrs = query_ptr + seq * query_stride_t + heads[:, None] * query_stride_h
    q_mask = group_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptrs + dims[None, :], mask=q_mask, other=0.0)

    # Each sequence's own context is split (in whole steps), so a launch sized
    # for a longer bound (a CUDA graph's) still spreads a short one out.
    split_size = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)
    if ROTARY:
        # Dim d pairs with d + half (d < half) or d - half: rotate_half.
        half = head_size // 2
        pair = tl.where(dims < half, dims + half, dims - half)
        angle = cos_sin_ptr + tl.load(positions_ptr + seq).to(tl.int64) * head_size + dims % half
        cos = tl.load(angle, mask=dim_valid, other=0.0).to(tl.float32)
        sin = tl.load(angle + half, mask=dim_valid, other=0.0).to(tl.float32)
        sin = tl.where(dims < half, -sin, sin)
        q_pair = tl.load(q_ptrs + pair[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q_rotated = q.to(tl.float32) * cos[None, :] + q_pair * sin[None, :]
        if ROTATE:
            q_rotated = hadamard(q_rotated, BLOCK_G, BLOCK_D, LEVELS)
        q = q_rotated.to(q.dtype)
        q_rows = out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + dims[None, :]
        if ROTATE:
            # Staged in the output's rows (this program's heads; every split
            # of them stores the same values) and read back below: the
            # butterflies' layout would otherwise hold the query in registers
            # through the loop, where a loaded one is kept in shared memory.
            tl.store(q_rows, q, mask=q_mask)
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        writes = (start <= q_pos) & (q_pos < end) & (slot >= 0)
        slot = tl.where(slot >= 0, slot, 0)
        kv_mask = dim_valid & writes
        k_ptrs = key_ptr + seq * key_stride_t + kv_head * key_stride_h
        k = tl.load(k_ptrs + dims, mask=kv_mask, other=0.0).to(tl.float32)
        k_pair = tl.load(k_ptrs + pair, mask=kv_mask, other=0.0).to(tl.float32)
        v_ptrs = value_ptr + seq * value_stride_t + kv_head * value_stride_h
        v = tl.load(v_ptrs + dims, mask=kv_mask, other=0.0)
        dst = (
            (slot // BLOCK_SIZE) * cache_stride_b
            + (slot % BLOCK_SIZE) * cache_stride_s
            + kv_head * cache_stride_h
            + dims
        )
        cache_dtype = key_cache_ptr.dtype.element_ty
        key_out = k * cos + k_pair * sin
        if ROTATE:
            key_out = tl.reshape(hadamard(key_out[None, :], 1, BLOCK_D, LEVELS), [BLOCK_D])
        key_out = key_out.to(query_ptr.dtype.element_ty)
        if INT8:
            key_out = key_out.to(tl.float32)
            v = v.to(tl.float32)
            k_token_scale = int8_scale(key_out, 0)
            v_token_scale = int8_scale(v, 0)
            key_out = quantize_int8(key_out, k_token_scale.to(tl.float32))
            v = quantize_int8(v, v_token_scale.to(tl.float32))
            scale_dst = (
                (slot // BLOCK_SIZE) * scale_stride_b
                + (slot % BLOCK_SIZE) * scale_stride_s
                + kv_head * scale_stride
            )
            tl.store(k_scale_ptr + scale_dst, k_token_scale, mask=writes)
            tl.store(v_scale_ptr + scale_dst, v_token_scale, mask=writes)
        key_out = quantize(key_out, k_scale, FP8, FP8_MAX).to(cache_dtype)
        v = quantize(v, v_scale, FP8, FP8_MAX).to(cache_dtype)
        tl.store(key_cache_ptr + dst, key_out, mask=kv_mask)
        tl.store(value_cache_ptr + dst, v, mask=kv_mask)
        tl.debug_barrier()  # the new key and value are read below, by other threads
        if ROTATE:
            q = tl.load(q_rows, mask=q_mask, other=0.0)
    if FP8 or INT8:
        q = q.to(tl.float16)  # the tiles' dtype too (kv_quant)
    if USE_WINDOW:
        first = tl.maximum(q_pos - sliding_window + 1, 0)
        start = tl.maximum(start, (first // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_G], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    q_pos_rows = tl.zeros([BLOCK_G], dtype=tl.int64) + q_pos
    # Whole tiles need no mask (every key is at or before the query); the
    # last, partial one does, and so does every tile under a window.
    full_end = start
    if not USE_WINDOW:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = attend_span(
        q,
        q_pos_rows,
        m_i,
        l_i,
        acc,
        start,
        full_end,
        end,
        seq,
        kv_head,
        key_cache_ptr,
        value_cache_ptr,
        block_table_ptr,
        cache_stride_b,
        cache_stride_s,
        cache_stride_h,
        block_table_stride,
        scale * k_scale,
        softcap,
        sliding_window,
        dims,
        dim_valid,
        k_scale_ptr + kv_head * scale_stride,
        v_scale_ptr + kv_head * scale_stride,
        scale_stride_b,
        scale_stride_s,
        USE_WINDOW,
        USE_SOFTCAP,
        BLOCK_SIZE,
        BLOCK_N,
        EVEN_D,
        WIDEN_V,
        PREFETCH,
        INT8,
        SCALE_TILES,
        WORDS,
    )

    if SPLIT:
        # An empty split (past the sequence, or before its window) has l_i == 0.
        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if FP8:
            out = out * v_scale
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), MASKED)  # base 2
        row = (seq * num_q_heads + heads) * num_splits + split
        tl.store(
            partial_out_ptr + row[:, None] * head_size + dims[None, :],
            out,
            mask=group_valid[:, None] & dim_valid[None, :],
        )
        tl.store(partial_lse_ptr + row, lse, mask=group_valid)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if FP8:
            out = out * v_scale
        tl.store(
            out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=group_valid[:, None] & dim_valid[None, :],
        )
