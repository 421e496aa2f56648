"""The Gluon prefill with warps of its own for each task (sm_90): a
program's 128 query rows are split between two warpgroups of 64 that only
compute (scores, softmax, ``P V``), and a third warpgroup only copies K/V
pages through the block table into a ring of shared-memory buffers.
mbarriers order them: a buffer is *full* once every copier thread's
``cp.async`` copies have landed, and *empty* once both computing
warpgroups' products have read it. With no barrier across the program,
each computing warpgroup runs at its own pace: one's softmax can run
while the other's products hold the tensor cores, which the single-role
kernel (``prefill_gluon``'s schedules 0 to 2), whose warpgroups met at a
barrier each step, could not do.

``prefill_gluon.prefill`` launches it for ``TILING``'s schedules 3 and 4
(the computing warpgroups free, or taking turns at the tensor cores), and
6 and 7 (the same, the copier's pages moved by the Tensor Memory
Accelerator: a copy a page, issued by one thread, instead of a ``cp.async``
a thread each 16 bytes); the batches, the tile schedule and the arguments
are ``prefill_gluon``'s. A computing warpgroup's work is
``gluon_rows``'s; ``prefill_persistent`` runs the same partitions in
persistent programs (schedule 5, and 8 with the pages copied so).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.language.nvidia.hopper.mbarrier import expect

from pagedkv.kernels import gluon_rows, gluon_steps

# The copying warpgroup's warps and each partition's registers a thread:
# three warpgroups share a multiprocessor's 64K registers (the launch's
# ``maxnreg`` times 384 threads), the copiers need few.
COPY_WARPS = gl.constexpr(4)
COPY_REGISTERS = gl.constexpr(40)
COMPUTE_REGISTERS = gl.constexpr(232)
KERNEL_REGISTERS = 168
# Tiles of up to COPY_TILE keys are copied at once; larger ones COPY_ROWS
# rows at a time (at once, a 128-key tile's addresses spilled 336 bytes a
# thread).
COPY_TILE = gl.constexpr(64)
COPY_ROWS = gl.constexpr(32)


@gluon.jit
def _copy_partition(
    key_cache_ptr,
    value_cache_ptr,
    k_smem,
    v_smem,
    full,
    empty,
    row_table,
    kv_end,
    num_kv_tiles,
    kv_head,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    WHOLE: gl.constexpr,
    CHUNK: gl.constexpr,
):
    """Copies K/V tiles 0 .. num_kv_tiles - 1 into the ring, each into a
    buffer both computing warpgroups have released; every thread's
    copies of a tile arrive on its *full* barrier once they land. A tile
    of up to ``WHOLE`` keys is copied at once, its pages read a tile
    ahead; a larger one ``CHUNK`` rows at a time, their pages read as
    they go (at once, its addresses would spill)."""
    layout: gl.constexpr = gluon_steps.load_layout(HEAD, WARPS)
    if BLOCK_N <= WHOLE:
        pages = gluon_steps.gather_pages(row_table, 0, kv_end, BLOCK_N, BLOCK_SIZE, layout)
    for t in range(num_kv_tiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        if BLOCK_N <= WHOLE:
            pages = gluon_steps.issue_tile(
                key_cache_ptr, value_cache_ptr, k_smem, v_smem, pages, t, row_table, kv_end,
                kv_head, cache_stride_b, cache_stride_s, cache_stride_h, BLOCK_N, BLOCK_SIZE,
                HEAD, STAGES, layout,
            )  # fmt: skip
        else:
            gluon_steps.copy_rows(
                key_cache_ptr, value_cache_ptr, k_smem.index(slot), v_smem.index(slot),
                t * BLOCK_N, row_table, kv_end, kv_head, cache_stride_b, cache_stride_s,
                cache_stride_h, BLOCK_SIZE, HEAD, CHUNK, layout,
            )  # fmt: skip
        async_copy.mbarrier_arrive(full.index(slot), increment_count=False)


@gluon.jit
def tma_copy_tiles(
    key_desc,
    value_desc,
    key_cache_ptr,
    value_cache_ptr,
    k_smem,
    v_smem,
    full,
    empty,
    row_table,
    kv_end,
    num_kv_tiles,
    kv_head,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    ring,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    CHUNK: gl.constexpr,
):
    """``_copy_partition``'s work by the Tensor Memory Accelerator, the
    tiles taking the ring's buffers from its ``ring``-th on: each
    page's rows of a tile (``key_desc`` and ``value_desc`` view a cache as
    ``[num_blocks * block_size, num_kv_heads * head_size]``) in one copy,
    the block table read a tile ahead. The last tile, which holds the keys
    past ``kv_end``, goes by ``cp.async``, ``CHUNK`` rows at a time, those
    rows zeroed: a block's slots past its sequence's end hold whatever the
    block held before, and a product by a zero weight keeps an inf or a NaN
    there. A buffer is *full* once its tile's bytes (the copy expected)
    and every copier thread's ``cp.async`` copies (none for the other
    tiles) have landed."""
    ROWS: gl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N  # a copy's
    COPIES: gl.constexpr = BLOCK_N // ROWS
    TILE_BYTES: gl.constexpr = 2 * BLOCK_N * HEAD * key_desc.dtype.primitive_bitwidth // 8
    # A tile's copies, every thread holding them all.
    layout: gl.constexpr = gl.BlockedLayout([COPIES], [32], [WARPS], [0])
    copies = gl.arange(0, COPIES, layout=layout)
    column = (kv_head * HEAD).to(gl.int32)
    pages = gl.load(row_table + copies * ROWS // BLOCK_SIZE, mask=copies * ROWS < kv_end, other=0)
    for t in range(num_kv_tiles):
        slot = (ring + t) % STAGES
        pos = t * BLOCK_N + copies * ROWS
        rows = pages * BLOCK_SIZE + pos % BLOCK_SIZE
        ahead = pos + BLOCK_N  # the next tile's pages, read while this one's copies go
        pages = gl.load(row_table + ahead // BLOCK_SIZE, mask=ahead < kv_end, other=0)
        mbarrier.wait(empty.index(slot), (((ring + t) // STAGES) & 1) ^ 1)
        if t < num_kv_tiles - 1:
            expect(full.index(slot), TILE_BYTES)
            for c in gl.static_range(COPIES):
                row = gl.sum(gl.where(copies == c, rows, 0), 0)
                k_rows = k_smem.index(slot).slice(c * ROWS, ROWS)
                v_rows = v_smem.index(slot).slice(c * ROWS, ROWS)
                tma.async_copy_global_to_shared(key_desc, [row, column], full.index(slot), k_rows)
                tma.async_copy_global_to_shared(value_desc, [row, column], full.index(slot), v_rows)
        else:
            mbarrier.arrive(full.index(slot))
            gluon_steps.copy_rows(
                key_cache_ptr, value_cache_ptr, k_smem.index(slot), v_smem.index(slot),
                t * BLOCK_N, row_table, kv_end, kv_head, cache_stride_b, cache_stride_s,
                cache_stride_h, BLOCK_SIZE, HEAD, CHUNK, gluon_steps.load_layout(HEAD, WARPS),
            )  # fmt: skip
        async_copy.mbarrier_arrive(full.index(slot), increment_count=False)


@gluon.jit
def allocate_ring(
    dtype: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    TMA: gl.constexpr = False,
):
    """The K/V ring (``STAGES`` buffers of ``BLOCK_N`` keys) and its
    barriers: a *full* one a buffer (an arrival from each copier thread,
    and with ``TMA`` the one that expects the tile's bytes), an *empty* one
    (one from each computing warpgroup) and the two computing warpgroups'
    turns."""
    smem_layout: gl.constexpr = gluon_steps.shared_layout()
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], smem_layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=COPY_WARPS * 32 + (1 if TMA else 0))
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    return k_smem, v_smem, full, empty, turn


@gluon.jit
def scheduled_tile(tiles_ptr, num_tiles, entry, BLOCK_M: gl.constexpr):
    """A tile schedule's ``entry`` (``tiles_ptr``: ``[2, num_tiles]``):
    its sequence and first row, past every row for an entry with no tile."""
    seq = gl.load(tiles_ptr + entry).to(gl.int64)
    tile = gl.load(tiles_ptr + num_tiles + entry).to(gl.int64)
    tile = gl.where(seq >= 0, tile, 1 << 24)  # no tile: no row, no key
    return gl.maximum(seq, 0), tile * BLOCK_M


@gluon.jit
def tile_keys(seq, row0, seq_lens_ptr, query_start_loc_ptr, BLOCK_M: gl.constexpr):
    """For the tile of rows ``row0`` onwards of sequence ``seq``: the
    sequence's first query and queries, its cached keys, and the tile's
    key end."""
    q_start = gl.load(query_start_loc_ptr + seq).to(gl.int64)
    q_len = gl.load(query_start_loc_ptr + seq + 1).to(gl.int64) - q_start
    context = gl.load(seq_lens_ptr + seq).to(gl.int64) - q_len
    return q_start, q_len, context, context + gl.minimum(row0 + BLOCK_M, q_len)


@gluon.jit
def prefill_specialized_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,
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
    qk_scale,  # the softmax scale times log2(e)
    num_queries_per_kv,
    num_tiles,
    key_desc,  # with TMA: the caches' tensor descriptors (tma_copy_tiles')
    value_desc,
    TILED: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,  # a program's rows: a schedule tile's
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    TMA: gl.constexpr,
    num_warps: gl.constexpr,
):
    # The grid as prefill_kernel's: heads fastest, the longest (last) tiles first.
    head = gl.program_id(0).to(gl.int64)
    if TILED:
        seq, row0 = scheduled_tile(tiles_ptr, num_tiles, gl.program_id(1), BLOCK_M)
    else:
        row0 = (gl.num_programs(1) - 1 - gl.program_id(1)).to(gl.int64) * BLOCK_M
        seq = gl.program_id(2).to(gl.int64)
    kv_head = head // num_queries_per_kv
    q_start, q_len, context, kv_end = tile_keys(
        seq, row0, seq_lens_ptr, query_start_loc_ptr, BLOCK_M
    )
    if row0 < q_len:
        k_smem, v_smem, full, empty, turn = allocate_ring(
            query_ptr.dtype.element_ty, BLOCK_N, HEAD, STAGES, TMA
        )
        num_kv_tiles = gl.cdiv(kv_end, BLOCK_N).to(gl.int32)
        row_table = block_table_ptr + seq * block_table_stride
        # fmt: off
        gl.warp_specialize(
            [
                # The computing warpgroups from the ring's first tile and turn.
                (gluon_rows.compute_rows, (
                    query_ptr, out_ptr, k_smem, v_smem, full, empty, turn, 0, 0, q_start, q_len,
                    context, row0, num_kv_tiles, head, query_stride_t, query_stride_h,
                    out_stride_t, out_stride_h, qk_scale, 0, BLOCK_N, HEAD, STAGES, PINGPONG,
                )),
                (gluon_rows.compute_rows, (
                    query_ptr, out_ptr, k_smem, v_smem, full, empty, turn, 0, 0, q_start, q_len,
                    context, row0, num_kv_tiles, head, query_stride_t, query_stride_h,
                    out_stride_t, out_stride_h, qk_scale, 1, BLOCK_N, HEAD, STAGES, PINGPONG,
                )),
                (tma_copy_tiles, (
                    key_desc, value_desc, key_cache_ptr, value_cache_ptr, k_smem, v_smem, full,
                    empty, row_table, kv_end, num_kv_tiles, kv_head, cache_stride_b,
                    cache_stride_s, cache_stride_h, 0, BLOCK_N, BLOCK_SIZE, HEAD, STAGES,
                    COPY_WARPS, COPY_ROWS if COPY_ROWS < BLOCK_N else BLOCK_N,
                )) if TMA else (_copy_partition, (
                    key_cache_ptr, value_cache_ptr, k_smem, v_smem, full, empty, row_table,
                    kv_end, num_kv_tiles, kv_head, cache_stride_b, cache_stride_s,
                    cache_stride_h, BLOCK_N, BLOCK_SIZE, HEAD, STAGES, COPY_WARPS, COPY_TILE,
                    COPY_ROWS,
                )),
            ],
            [4, COPY_WARPS],
            [COMPUTE_REGISTERS, COPY_REGISTERS],
        )
        # fmt: on
