"""The Gluon prefill with warps of their own (``prefill_specialized``) in
persistent programs (``TILING``'s schedule 5; 8 with the pages copied
by the Tensor Memory Accelerator): one program a
multiprocessor, each taking tiles in the order a program a tile would run
(heads fastest, the longest first) and in turn. One program of 384
threads fills a multiprocessor, so a program a tile starts cold (its Q,
then its first K/V tile, arrive with the tensor cores idle); here the
copying warpgroup goes on from one tile's K/V to the next tile's through
one ring, so the next tile's first buffers fill while the computing
warpgroups finish the last one's rows. The ring's and the turns' counts
carry from tile to tile.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier

from pagedkv.kernels import gluon_rows, gluon_steps, prefill_specialized
from pagedkv.kernels.prefill_specialized import (
    COMPUTE_REGISTERS,
    COPY_REGISTERS,
    COPY_ROWS,
    COPY_WARPS,
    scheduled_tile,
    tile_keys,
)


@gluon.jit
def _item(
    item,
    num_heads,
    num_row_tiles,
    tiles_ptr,
    num_tiles,
    seq_lens_ptr,
    query_start_loc_ptr,
    TILED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """A persistent program's ``item``-th tile, in the order a program a
    tile takes them (heads fastest, then the tile schedule's entries, or
    each sequence's row tiles, the last first): its query head, sequence,
    first row, the sequence's first query and queries, its cached keys,
    the tile's key end and K/V tiles (0 for a tile with no row)."""
    head = (item % num_heads).to(gl.int64)
    rest = item // num_heads
    if TILED:
        seq, row0 = scheduled_tile(tiles_ptr, num_tiles, rest, BLOCK_M)
    else:
        row0 = (num_row_tiles - 1 - rest % num_row_tiles).to(gl.int64) * BLOCK_M
        seq = (rest // num_row_tiles).to(gl.int64)
    q_start, q_len, context, kv_end = tile_keys(
        seq, row0, seq_lens_ptr, query_start_loc_ptr, BLOCK_M
    )
    num_kv_tiles = gl.where(row0 < q_len, gl.cdiv(kv_end, BLOCK_N), 0).to(gl.int32)
    return head, seq, row0, q_start, q_len, context, kv_end, num_kv_tiles


@gluon.jit
def _copy_items(
    key_cache_ptr,
    value_cache_ptr,
    k_smem,
    v_smem,
    full,
    empty,
    block_table_ptr,
    block_table_stride,
    seq_lens_ptr,
    query_start_loc_ptr,
    tiles_ptr,
    num_tiles,
    num_heads,
    num_row_tiles,
    num_items,
    num_queries_per_kv,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    key_desc,
    value_desc,
    TILED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    CHUNK: gl.constexpr,
    TMA: gl.constexpr,
):
    """The copying warpgroup of a persistent program: every K/V tile of
    its items, in turn, through one ring (``CHUNK`` rows at a time, or
    with ``TMA`` a page a copy, ``prefill_specialized.tma_copy_tiles``),
    so that the next item's first tiles land while the computing
    warpgroups finish the last one's."""
    layout: gl.constexpr = gluon_steps.load_layout(HEAD, WARPS)
    ring = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        head, seq, _, _, _, _, kv_end, num_kv_tiles = _item(
            item, num_heads, num_row_tiles, tiles_ptr, num_tiles, seq_lens_ptr,
            query_start_loc_ptr, TILED, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        row_table = block_table_ptr + seq * block_table_stride
        kv_head = head // num_queries_per_kv
        if TMA:
            prefill_specialized.tma_copy_tiles(
                key_desc, value_desc, key_cache_ptr, value_cache_ptr, k_smem, v_smem, full,
                empty, row_table, kv_end, num_kv_tiles, kv_head, cache_stride_b,
                cache_stride_s, cache_stride_h, ring, BLOCK_N, BLOCK_SIZE, HEAD, STAGES, WARPS,
                CHUNK,
            )  # fmt: skip
        else:
            for t in range(num_kv_tiles):
                slot = (ring + t) % STAGES
                mbarrier.wait(empty.index(slot), (((ring + t) // STAGES) & 1) ^ 1)
                gluon_steps.copy_rows(
                    key_cache_ptr, value_cache_ptr, k_smem.index(slot), v_smem.index(slot),
                    t * BLOCK_N, row_table, kv_end, kv_head, cache_stride_b, cache_stride_s,
                    cache_stride_h, BLOCK_SIZE, HEAD, CHUNK, layout,
                )  # fmt: skip
                async_copy.mbarrier_arrive(full.index(slot), increment_count=False)
        ring += num_kv_tiles


@gluon.jit
def _compute_items(
    query_ptr,
    out_ptr,
    k_smem,
    v_smem,
    full,
    empty,
    turn,
    seq_lens_ptr,
    query_start_loc_ptr,
    tiles_ptr,
    num_tiles,
    num_heads,
    num_row_tiles,
    num_items,
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    qk_scale,
    TILED: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """A computing warpgroup of a persistent program: its rows of each of
    the program's items, in turn, the ring and the turns going on from
    one item to the next."""
    ring = 0
    turns = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        head, _, row0, q_start, q_len, context, _, num_kv_tiles = _item(
            item, num_heads, num_row_tiles, tiles_ptr, num_tiles, seq_lens_ptr,
            query_start_loc_ptr, TILED, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if num_kv_tiles > 0:
            gluon_steps.cta_barrier()  # the warpgroup done with the last item's Q
            gluon_rows.compute_rows(
                query_ptr, out_ptr, k_smem, v_smem, full, empty, turn, ring, turns, q_start,
                q_len, context, row0, num_kv_tiles, head, query_stride_t, query_stride_h,
                out_stride_t, out_stride_h, qk_scale, HALF, BLOCK_N, HEAD, STAGES, PINGPONG,
            )  # fmt: skip
        ring += num_kv_tiles
        turns += gl.where(num_kv_tiles > 0, num_kv_tiles + 1, 0)


@gluon.jit
def prefill_persistent_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    tiles_ptr,  # with TILED: [2, num_tiles], each tile's sequence (-1: none) and tile
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_table_stride,
    qk_scale,  # the softmax scale times log2(e)
    num_queries_per_kv,
    num_tiles,
    num_heads,
    num_row_tiles,  # without TILED: row tiles a sequence
    num_items,  # tiles times heads
    key_desc,  # with TMA: the caches' tensor descriptors (prefill_specialized.tma_copy_tiles')
    value_desc,
    TILED: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    TMA: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``prefill_specialized_kernel``'s work in programs that each take
    tiles ``program_id``, ``program_id + num_programs``, ... (a
    multiprocessor's worth of programs): one ring of K/V buffers, its
    barriers set up once, the copies of the next tile's K/V under way
    while the last tile's rows finish."""
    k_smem, v_smem, full, empty, turn = prefill_specialized.allocate_ring(
        query_ptr.dtype.element_ty, BLOCK_N, HEAD, STAGES, TMA
    )
    # fmt: off
    gl.warp_specialize(
        [
            (_compute_items, (
                query_ptr, out_ptr, k_smem, v_smem, full, empty, turn, seq_lens_ptr,
                query_start_loc_ptr, tiles_ptr, num_tiles, num_heads, num_row_tiles, num_items,
                query_stride_t, query_stride_h, out_stride_t, out_stride_h, qk_scale, TILED, 0,
                BLOCK_M, BLOCK_N, HEAD, STAGES, PINGPONG,
            )),
            (_compute_items, (
                query_ptr, out_ptr, k_smem, v_smem, full, empty, turn, seq_lens_ptr,
                query_start_loc_ptr, tiles_ptr, num_tiles, num_heads, num_row_tiles, num_items,
                query_stride_t, query_stride_h, out_stride_t, out_stride_h, qk_scale, TILED, 1,
                BLOCK_M, BLOCK_N, HEAD, STAGES, PINGPONG,
            )),
            (_copy_items, (
                key_cache_ptr, value_cache_ptr, k_smem, v_smem, full, empty, block_table_ptr,
                block_table_stride, seq_lens_ptr, query_start_loc_ptr, tiles_ptr, num_tiles,
                num_heads, num_row_tiles, num_items, num_queries_per_kv, cache_stride_b,
                cache_stride_s, cache_stride_h, key_desc, value_desc, TILED, BLOCK_M, BLOCK_N,
                BLOCK_SIZE, HEAD, STAGES, COPY_WARPS, COPY_ROWS, TMA,
            )),
        ],
        [4, COPY_WARPS],
        [COMPUTE_REGISTERS, COPY_REGISTERS],
    )
    # fmt: on
