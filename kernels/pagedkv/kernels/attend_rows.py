"""``attend`` with the keys as the rows of both dots: a decode program's
scores are ``K @ q^T`` (``[BLOCK_N, ROWS]``) and its output ``V^T @ P^T``
(``[BLOCK_D, ROWS]``), so the tiles, not the few query rows, fill the
tensor cores' long side. On sm_90 that side is 64 rows for a warpgroup's
``wgmma``, which reads the loop-invariant query from shared memory where
the row-major form (16 query rows: ``mma.sync``) reloads it from shared
memory into registers every step. The online softmax is ``attend``'s,
reduced over axis 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.kernels.attend import LOG2E, MASKED, load_scales, load_tile, load_words, widen


@triton.jit
def attend_rows(
    q_t,  # [BLOCK_D, ROWS] the query rows, transposed
    q_pos,  # [ROWS]
    m_i,  # [ROWS] running max score (base 2)
    l_i,  # [ROWS]
    acc_t,  # [BLOCK_D, ROWS] float32, the running output transposed
    kv_start,
    kv_end,
    seq,
    kv_head,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_table_stride,
    scale,
    softcap,
    sliding_window,
    dims,
    dim_valid,
    k_scale_ptr,
    v_scale_ptr,
    scale_stride_b,
    scale_stride_s,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    MASK: tl.constexpr,
    INT8: tl.constexpr = False,
    WORDS: tl.constexpr = 0,
    PREFETCH: tl.constexpr = False,
):
    """``attend`` over keys ``kv_start .. kv_end - 1`` with the keys as
    rows: its arguments, its ``MASK``, ``INT8`` scaled scores, ``WORDS``
    (here K's and V's) and ``PREFETCH``'s block table a step ahead."""
    BLOCK_D: tl.constexpr = dims.shape[0]
    row_table = block_table_ptr + seq * block_table_stride
    if PREFETCH:
        first_pos = kv_start + tl.arange(0, BLOCK_N)
        pages = tl.load(row_table + first_pos // BLOCK_SIZE, mask=first_pos < kv_end, other=0).to(
            tl.int64
        )
    for start in range(kv_start, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        if not PREFETCH:
            table = row_table + k_pos // BLOCK_SIZE
            if MASK:
                pages = tl.load(table, mask=k_valid, other=0).to(tl.int64)
            else:
                pages = tl.load(table).to(tl.int64)
        kv_offsets = (
            pages * cache_stride_b
            + (k_pos % BLOCK_SIZE) * cache_stride_s
            + kv_head * cache_stride_h
        )
        if WORDS:
            k = load_words(key_cache_ptr, kv_offsets, k_valid, BLOCK_D, MASK, WORDS, False)
            v_t = load_words(value_cache_ptr, kv_offsets, k_valid, BLOCK_D, MASK, WORDS, True)
        else:
            k_ptrs = key_cache_ptr + kv_offsets[:, None] + dims[None, :]
            k = widen(load_tile(k_ptrs, k_valid, dim_valid, MASK, EVEN_D), q_t, INT8)
            v_ptrs = value_cache_ptr + kv_offsets[None, :] + dims[:, None]
            v_t = widen(load_tile(v_ptrs, k_valid, dim_valid, MASK, EVEN_D, True), q_t, INT8)
        if INT8:
            scale_offsets = pages * scale_stride_b + (k_pos % BLOCK_SIZE) * scale_stride_s
            k_scales = load_scales(k_scale_ptr, scale_offsets, k_valid, MASK)
            v_scales = load_scales(v_scale_ptr, scale_offsets, k_valid, MASK)
        if PREFETCH:
            next_pos = k_pos + BLOCK_N
            pages = tl.load(row_table + next_pos // BLOCK_SIZE, mask=next_pos < kv_end, other=0).to(
                tl.int64
            )
        qk = tl.dot(k, q_t)  # [BLOCK_N, ROWS]
        if INT8:
            qk = qk * k_scales[:, None]
        if USE_SOFTCAP:
            scores = qk * scale
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0) * LOG2E
        else:
            scores = qk * (scale * LOG2E)
        if MASK:
            allowed = k_valid[:, None] & (k_pos[:, None] <= q_pos[None, :])
            if USE_WINDOW:
                allowed = allowed & (k_pos[:, None] > q_pos[None, :] - sliding_window)
            scores = tl.where(allowed, scores, MASKED)
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        weights = p
        if INT8:
            weights = p * v_scales[:, None]
        acc_t = tl.dot(v_t, weights.to(q_t.dtype), acc_t * alpha[None, :])
        m_i = m_new
    return m_i, l_i, acc_t
