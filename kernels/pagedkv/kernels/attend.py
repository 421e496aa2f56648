"""The online-softmax step that both attention kernels share: one K/V tile
at a time through a sequence's block table, scores in base 2."""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.kernels.tiles import load_scales, load_tile, load_values, load_words, widen

# A score no real one reaches; finite so that exp() never sees inf - inf.
MASKED = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def attend(
    q,  # [ROWS, BLOCK_D] query rows
    q_pos,  # [ROWS] position of each row
    m_i,  # [ROWS] running max score (base 2)
    l_i,  # [ROWS] running sum of exp2(score - m_i)
    acc,  # [ROWS, BLOCK_D] running weighted sum of values, float32
    kv_start,
    kv_end,
    seq,
    kv_head,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_table_stride,
    scale,
    softcap,
    sliding_window,
    dims,  # [BLOCK_D]
    dim_valid,  # [BLOCK_D]
    k_scale_ptr,  # INT8: this KV head's K scales, float16, of slot 0 of block 0
    v_scale_ptr,
    scale_stride_b,
    scale_stride_s,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    MASK: tl.constexpr,
    WIDEN_V: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    INT8: tl.constexpr = False,
    SCALE_TILES: tl.constexpr = False,
    WORDS: tl.constexpr = 0,
    FUSED_SCALE: tl.constexpr = False,
):
    """Online softmax of the rows over keys ``kv_start .. kv_end - 1`` of one
    sequence's KV head, read ``BLOCK_N`` at a time through its block table.
    An fp8 cache's tiles are read as the query's dtype (float16, from the
    caller: ``kv_quant``): ``scale`` includes the key scale, and the caller
    multiplies the output by the value scale.
    ``MASK`` off promises full tiles that every row sees in whole (below the
    causal diagonal, no window): no load or score masks then. Scores are kept
    in base 2.
    ``WIDEN_V`` (for an fp8 cache) loads each V tile as its transpose and
    widens it before it is laid out for the dot: the compiler then moves
    16-bit values into the dot's layout (through shared memory, read back
    with ldmatrix), where without it the fp8 tile is laid out for the dot
    first and read from shared memory a byte at a time.
    ``PREFETCH`` reads each tile's block table entries one step ahead (the
    next tile's while this one's K and V load), and both the K and the V
    tile before the scores, so that no load of a step waits for another of
    that step.
    ``INT8``: the cache holds int8 values with a float16 scale per token
    (``kv_quant``): each key's scores are multiplied by its K scale and each
    softmax weight by its value's V scale before the dot with the V tile;
    with ``SCALE_TILES``, each K and V tile's rows are multiplied by their
    tokens' scales instead, in float16. Scaling the scores keeps a decode
    program's registers (its rows are few); scaling the tiles keeps the
    prefill's (``paged_attention.PREFILL_INT8_SCALE_TILES``).
    ``WORDS`` (a quantized cache, ``BLOCK_D == head_size``): V tiles are
    read as 32-bit words and widened four values a word (``load_words``),
    where the compiler, given a byte tile, unpacks each byte to a register
    and packs pairs again for the conversion; an int8 cache's K tiles too
    (its widening unpacks them as well, where an fp8 K
    tile goes through shared memory to its conversion in pairs).
    ``FUSED_SCALE`` (unmasked tiles without a soft-cap): the scale, which
    must be positive, is applied inside each score's exp2 (a row's max is
    scaled once) rather than to every score first."""
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
        kv_ptrs = kv_offsets[:, None] + dims[None, :]
        # An fp8 tile is widened to the query's dtype (its scales are the caller's).
        if WORDS and INT8:  # an fp8 K tile's bytes reach its conversion in pairs
            k = load_words(key_cache_ptr, kv_offsets, k_valid, dims.shape[0], MASK, WORDS, False)
        else:
            k = widen(load_tile(key_cache_ptr + kv_ptrs, k_valid, dim_valid, MASK, EVEN_D), q, INT8)
        if INT8:
            scale_offsets = pages * scale_stride_b + (k_pos % BLOCK_SIZE) * scale_stride_s
            k_scales = load_scales(k_scale_ptr, scale_offsets, k_valid, MASK)
            if PREFETCH:
                v_scales = load_scales(v_scale_ptr, scale_offsets, k_valid, MASK)
        if PREFETCH:
            v = load_values(
                value_cache_ptr,
                kv_ptrs,
                kv_offsets,
                k_valid,
                dim_valid,
                q,
                MASK,
                EVEN_D,
                WIDEN_V,
                INT8,
                WORDS,
            )
            next_pos = k_pos + BLOCK_N
            pages = tl.load(row_table + next_pos // BLOCK_SIZE, mask=next_pos < kv_end, other=0).to(
                tl.int64
            )
        if INT8 and SCALE_TILES:
            k = k * k_scales.to(tl.float16)[:, None]
        qk = tl.dot(q, tl.trans(k))
        if INT8 and not SCALE_TILES:
            qk = qk * k_scales[None, :]
        if FUSED_SCALE and not (MASK or USE_SOFTCAP):
            # The scale (positive) taken inside exp2's argument: one FFMA a
            # score where scaling first, then subtracting takes two.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * (scale * LOG2E))
            p = tl.exp2(qk * (scale * LOG2E) - m_new[:, None])
        else:
            if USE_SOFTCAP:
                scores = qk * scale
                scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0) * LOG2E
            else:
                scores = qk * (scale * LOG2E)  # softmax in base 2: exp2 is one instruction
            if MASK:
                allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
                if USE_WINDOW:
                    allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
                scores = tl.where(allowed, scores, MASKED)
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not PREFETCH:
            v = load_values(
                value_cache_ptr,
                kv_ptrs,
                kv_offsets,
                k_valid,
                dim_valid,
                q,
                MASK,
                EVEN_D,
                WIDEN_V,
                INT8,
                WORDS,
            )
            if INT8:
                v_scales = load_scales(v_scale_ptr, scale_offsets, k_valid, MASK)
        weights = p
        if INT8 and SCALE_TILES:
            v = v * v_scales.to(tl.float16)[:, None]
        elif INT8:
            weights = p * v_scales[None, :]
        acc = tl.dot(weights.to(q.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def attend_span(
    q,
    q_pos,
    m_i,
    l_i,
    acc,
    kv_start,
    diagonal,
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
    WIDEN_V: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    INT8: tl.constexpr = False,
    SCALE_TILES: tl.constexpr = False,
    WORDS: tl.constexpr = 0,
    FUSED_SCALE: tl.constexpr = False,
):
    """``attend`` over keys ``kv_start .. kv_end - 1``: those before
    ``diagonal`` (whole tiles every row sees) without masks, the rest
    masked. Every kernel's keys split this way."""
    m_i, l_i, acc = attend(
        q,
        q_pos,
        m_i,
        l_i,
        acc,
        kv_start,
        diagonal,
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
        USE_WINDOW,
        USE_SOFTCAP,
        BLOCK_SIZE,
        BLOCK_N,
        EVEN_D,
        False,
        WIDEN_V,
        PREFETCH,
        INT8,
        SCALE_TILES,
        WORDS,
        FUSED_SCALE,
    )
    m_i, l_i, acc = attend(
        q,
        q_pos,
        m_i,
        l_i,
        acc,
        diagonal,
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
        USE_WINDOW,
        USE_SOFTCAP,
        BLOCK_SIZE,
        BLOCK_N,
        EVEN_D,
        True,
        WIDEN_V,
        PREFETCH,
        INT8,
        SCALE_TILES,
        WORDS,
        FUSED_SCALE,
    )
    return m_i, l_i, acc
