"""The paged-attention program (``paged_attention`` launches it): ``BLOCK_M``
query tokens of one sequence for one query head (or, with ``TILED``, the
tile a schedule names), streaming that sequence's K/V page by page through
its block table with an online softmax. Its tiling and the launcher live
in ``paged_attention``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.kernels.attend import MASKED, attend_span


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    tiles_ptr,  # with TILED: [2, num_tiles], each program's sequence (-1: none) and tile
    out_ptr,  # [num_tokens, num_q_heads, head_size]
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
    num_queries_per_kv,
    num_tiles,
    k_scale_ptr,  # FP8: [1] or [num_kv_heads], float32; INT8: per token (kv_quant)
    v_scale_ptr,
    scale_stride,
    scale_stride_b,
    scale_stride_s,
    TILED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE_N: tl.constexpr,  # keys a step of a decode entry's tiles
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    GROUP: tl.constexpr,  # rows of a decode entry's tile: the query heads of a KV head, padded
    FP8: tl.constexpr,
    WIDEN_V: tl.constexpr,  # attend's: V tiles of an fp8 cache widened before the dot's layout
    INT8: tl.constexpr,
    SCALE_TILES: tl.constexpr,  # attend's: INT8 tiles scaled, not their scores
    FUSED_SCALE: tl.constexpr,  # attend's: the scale inside exp2's argument (unmasked tiles)
    PREFETCH: tl.constexpr,  # attend's: block table entries read a tile ahead
):
    # Heads vary fastest, so the query heads of a KV head run side by side and
    # share its K/V in L2; the last (longest, causal) tiles start first.
    head = tl.program_id(0).to(tl.int64)
    if TILED:  # the launch's schedule, from the device: a fixed grid (CUDA graphs)
        seq = tl.load(tiles_ptr + tl.program_id(1)).to(tl.int64)
        tile = tl.load(tiles_ptr + num_tiles + tl.program_id(1)).to(tl.int64)
        # A program with no tile takes sequence 0 past its last query: no row
        # is valid, no key is read, nothing is stored.
        tile = tl.where(seq >= 0, tile, 1 << 24)
        seq = tl.maximum(seq, 0)
    else:
        tile = (tl.num_programs(1) - 1 - tl.program_id(1)).to(tl.int64)
        seq = tl.program_id(2).to(tl.int64)
    kv_head = head // num_queries_per_kv
    token_k_scales = k_scale_ptr + kv_head * scale_stride  # INT8 (attend)
    token_v_scales = v_scale_ptr + kv_head * scale_stride
    k_scale = 1.0
    v_scale = 1.0
    if FP8:  # the cache's values times these scales (kv_quant)
        k_scale = tl.load(k_scale_ptr + kv_head * scale_stride)
        v_scale = tl.load(v_scale_ptr + kv_head * scale_stride)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context = seq_len - q_len

    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    if (q_len == 1) & (tile == 0):
        # A decode entry: the program of the group's first query head computes
        # every query head of its KV head, one row each, so each K/V byte is
        # read once for the group, in tiles of GROUP rows (not BLOCK_M rows
        # with one valid); the group's other programs have nothing to do.
        if head % num_queries_per_kv == 0:
            members = tl.arange(0, GROUP)
            heads = head + members
            head_valid = members < num_queries_per_kv
            offsets = q_start * query_stride_t + heads[:, None] * query_stride_h + dims[None, :]
            q = tl.load(
                query_ptr + offsets, mask=head_valid[:, None] & dim_valid[None, :], other=0.0
            )
            if FP8 or INT8:
                q = q.to(tl.float16)  # the tiles' dtype too (kv_quant)
            g_pos = tl.zeros([GROUP], dtype=tl.int64) + context
            g_m = tl.full([GROUP], MASKED, dtype=tl.float32)
            g_l = tl.zeros([GROUP], dtype=tl.float32)
            g_acc = tl.zeros([GROUP, BLOCK_D], dtype=tl.float32)
            g_start = seq_len * 0
            g_diagonal = (seq_len // DECODE_N) * DECODE_N  # whole tiles every row sees
            if USE_WINDOW:
                g_start = (tl.maximum(context - sliding_window + 1, 0) // DECODE_N) * DECODE_N
                g_diagonal = g_start
            g_m, g_l, g_acc = attend_span(
                q,
                g_pos,
                g_m,
                g_l,
                g_acc,
                g_start,
                g_diagonal,
                seq_len,
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
                token_k_scales,
                token_v_scales,
                scale_stride_b,
                scale_stride_s,
                USE_WINDOW,
                USE_SOFTCAP,
                BLOCK_SIZE,
                DECODE_N,
                EVEN_D,
                WIDEN_V,
                False,
                INT8,
                SCALE_TILES,
                0,
                FUSED_SCALE,
            )
            g_out = g_acc / tl.where(g_l > 0.0, g_l, 1.0)[:, None]
            if FP8:
                g_out = g_out * v_scale
            out_offsets = q_start * out_stride_t + heads[:, None] * out_stride_h + dims[None, :]
            tl.store(
                out_ptr + out_offsets,
                g_out.to(out_ptr.dtype.element_ty),
                mask=head_valid[:, None] & dim_valid[None, :],
            )
    else:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len
        q_pos = context + rows
        q_offsets = (
            (q_start + rows)[:, None] * query_stride_t + head * query_stride_h + dims[None, :]
        )
        q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        if FP8 or INT8:
            q = q.to(tl.float16)

        # Keys this tile reads: up to its last query's position, from the first
        # key its first query's window reaches (a multiple of BLOCK_N).
        kv_end = context + tl.minimum((tile + 1) * BLOCK_M, q_len)
        kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)
        kv_start = kv_end * 0
        if USE_WINDOW:
            kv_start = tl.maximum(context + tile * BLOCK_M - sliding_window + 1, 0)
            kv_start = (kv_start // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], MASKED, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Keys before the tile's first query (rounded down to BLOCK_N) are seen by
        # every row: no mask there. With a window every key is masked (the
        # unmasked range is empty).
        diagonal = kv_start
        if not USE_WINDOW:
            diagonal = tl.minimum(((context + tile * BLOCK_M) // BLOCK_N) * BLOCK_N, kv_end)
        m_i, l_i, acc = attend_span(
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
            scale * k_scale,
            softcap,
            sliding_window,
            dims,
            dim_valid,
            token_k_scales,
            token_v_scales,
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
            0,
            FUSED_SCALE,
        )

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # l_i is 0 only in rows not stored
        if FP8:
            out = out * v_scale
        out_offsets = (q_start + rows)[:, None] * out_stride_t + head * out_stride_h + dims[None, :]
        tl.store(
            out_ptr + out_offsets,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
