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

``prefill_gluon.prefill`` launches it for ``TILING``'s schedule 3; the
batches, the tile schedule and the arguments are ``prefill_gluon``'s.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pagedkv.kernels import gluon_steps

# A computing warpgroup's query rows.
HALF_ROWS = gl.constexpr(64)
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
            for c in gl.static_range(BLOCK_N // CHUNK):
                _copy_rows(
                    key_cache_ptr, value_cache_ptr, k_smem.index(slot).slice(c * CHUNK, CHUNK),
                    v_smem.index(slot).slice(c * CHUNK, CHUNK), t * BLOCK_N + c * CHUNK,
                    row_table, kv_end, kv_head, cache_stride_b, cache_stride_s, cache_stride_h,
                    BLOCK_SIZE, HEAD, layout,
                )  # fmt: skip
        async_copy.mbarrier_arrive(full.index(slot), increment_count=False)


@gluon.jit
def _copy_rows(
    key_cache_ptr,
    value_cache_ptr,
    k_rows,
    v_rows,
    start,
    row_table,
    kv_end,
    kv_head,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    layout: gl.constexpr,
):
    """Starts the copies of keys and values ``start`` onwards into
    ``k_rows`` and ``v_rows`` (rows past ``kv_end`` zeroed), their pages
    read from the block table first."""
    CHUNK: gl.constexpr = k_rows.shape[0]
    k_pos = start + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
    pages = gl.load(row_table + k_pos // BLOCK_SIZE, mask=k_pos < kv_end, other=0)
    rows = (
        pages.to(gl.int64) * cache_stride_b
        + (k_pos % BLOCK_SIZE) * cache_stride_s
        + kv_head * cache_stride_h
    )
    dims = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
    offsets = rows[:, None] + dims[None, :]
    mask = (k_pos < kv_end)[:, None] & (dims < HEAD)[None, :]
    async_copy.async_copy_global_to_shared(k_rows, key_cache_ptr + offsets, mask=mask)
    async_copy.async_copy_global_to_shared(v_rows, value_cache_ptr + offsets, mask=mask)


@gluon.jit
def _ready(full, j, STAGES: gl.constexpr):
    """Waits for K/V tile ``j``'s copies and fences them for the tensor
    cores' reads."""
    mbarrier.wait(full.index(j % STAGES), (j // STAGES) & 1)
    fence_async_shared()


@gluon.jit
def _take_turn(turn, n, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """With ``PINGPONG``, waits for this warpgroup's ``n``-th turn at the
    tensor cores: the two computing warpgroups issue their products in
    alternation (the first goes first), so that one's softmax runs while
    the other's products do."""
    if PINGPONG:
        mbarrier.wait(turn.index(HALF), (n & 1) ^ (1 - HALF))


@gluon.jit
def _pass_turn(turn, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """With ``PINGPONG``, hands the tensor cores to the other computing
    warpgroup once this one's products are issued."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - HALF))


@gluon.jit
def _compute_rows(
    query_ptr,
    out_ptr,
    k_smem,
    v_smem,
    full,
    empty,
    turn,
    ring,
    turns,
    q_start,
    q_len,
    context,
    row0,
    num_kv_tiles,
    head,
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    qk_scale,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """Query rows ``row0 + HALF * 64`` onwards (64 of them) over the tiles
    their keys reach: each step issues tile j's scores and tile j - 1's
    ``P V`` together, computes tile j's softmax while the ``P V`` runs,
    then releases tile j - 1's buffer. Tiles past the rows' last key are
    waited for and released without work, so that the ring's phases stay
    in step with the other warpgroup's. Tile j is the ring's ``ring + j``-th
    and its turn (with ``PINGPONG``) the ``turns + j``-th: a persistent
    program's earlier items took the ones before."""
    BLOCK_M: gl.constexpr = HALF_ROWS
    WARPS: gl.constexpr = 4
    dtype: gl.constexpr = query_ptr.dtype.element_ty
    load_layout: gl.constexpr = gluon_steps.load_layout(HEAD, WARPS)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    first = row0 + HALF * BLOCK_M
    kv_end = context + gl.minimum(first + BLOCK_M, q_len)
    my_tiles = gl.where(first < q_len, gl.cdiv(kv_end, BLOCK_N), 0).to(gl.int32)
    if my_tiles > 0:
        rows = first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load_layout))
        dims = gl.arange(0, HEAD, layout=gl.SliceLayout(0, load_layout))
        row_mask = (rows < q_len)[:, None] & (dims < HEAD)[None, :]
        q_offsets = (
            (q_start + rows)[:, None] * query_stride_t + head * query_stride_h + dims[None, :]
        )
        q = gl.load(query_ptr + q_offsets, mask=row_mask, other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], smem_layout, q)
        fence_async_shared()
        gluon_steps.cta_barrier()  # the warpgroup's rows of Q, all stored

        # Keys before the rows' first query (rounded down to BLOCK_N) are
        # seen by every row: tiles before ``diagonal`` need no mask.
        diagonal = gl.minimum((context + first) // BLOCK_N, my_tiles).to(gl.int32)
        q_pos = context + first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([BLOCK_M], gluon_steps.MASKED, gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=o_layout)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        _ready(full, ring, STAGES)
        _take_turn(turn, turns, HALF, PINGPONG)
        s_token = warpgroup_mma(
            q_smem, k_smem.index(ring % STAGES).permute((1, 0)), s, use_acc=False, is_async=True
        )
        _pass_turn(turn, HALF, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s_token,))
        p, _, m_i, l_i = gluon_steps.softmax(s, m_i, l_i, q_pos, 0, kv_end, qk_scale, BLOCK_N, True)
        p = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, diagonal):
            s, acc, p, m_i, l_i = _step(
                j, ring + j, turns + j, s, acc, p, m_i, l_i, q_smem, k_smem, v_smem, full,
                empty, turn, q_pos, kv_end, qk_scale, HALF, BLOCK_N, STAGES, False, PINGPONG,
                p_layout,
            )  # fmt: skip
        for j in range(gl.maximum(diagonal, 1), my_tiles):
            s, acc, p, m_i, l_i = _step(
                j, ring + j, turns + j, s, acc, p, m_i, l_i, q_smem, k_smem, v_smem, full,
                empty, turn, q_pos, kv_end, qk_scale, HALF, BLOCK_N, STAGES, True, PINGPONG,
                p_layout,
            )  # fmt: skip
        last = ring + my_tiles - 1
        _take_turn(turn, turns + my_tiles, HALF, PINGPONG)
        acc_token = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        _pass_turn(turn, HALF, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(acc_token,))
        mbarrier.arrive(empty.index(last % STAGES))

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        out = gl.convert_layout(out.to(dtype), load_layout)
        out_offsets = (q_start + rows)[:, None] * out_stride_t + head * out_stride_h + dims[None, :]
        gl.store(out_ptr + out_offsets, out, mask=row_mask)
    else:  # no rows: the turn the first tile's scores would take
        _take_turn(turn, turns, HALF, PINGPONG)
        _pass_turn(turn, HALF, PINGPONG)
    # The other warpgroup's last tiles, a turn each: both take
    # num_kv_tiles + 1 turns.
    for j in range(my_tiles, num_kv_tiles):
        mbarrier.wait(full.index((ring + j) % STAGES), ((ring + j) // STAGES) & 1)
        mbarrier.arrive(empty.index((ring + j) % STAGES))
        _take_turn(turn, turns + j + 1, HALF, PINGPONG)
        _pass_turn(turn, HALF, PINGPONG)


@gluon.jit
def _compute_partition(
    query_ptr,
    out_ptr,
    k_smem,
    v_smem,
    full,
    empty,
    turn,
    q_start,
    q_len,
    context,
    row0,
    num_kv_tiles,
    head,
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    qk_scale,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """A computing warpgroup of a program of one tile: ``_compute_rows``
    from the ring's first tile."""
    _compute_rows(
        query_ptr, out_ptr, k_smem, v_smem, full, empty, turn, 0, 0, q_start, q_len, context,
        row0, num_kv_tiles, head, query_stride_t, query_stride_h, out_stride_t, out_stride_h,
        qk_scale, HALF, BLOCK_N, HEAD, STAGES, PINGPONG,
    )  # fmt: skip


@gluon.jit
def _step(
    j,
    r,
    n,
    s,
    acc,
    p,
    m_i,
    l_i,
    q_smem,
    k_smem,
    v_smem,
    full,
    empty,
    turn,
    q_pos,
    kv_end,
    qk_scale,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    MASK: gl.constexpr,
    PINGPONG: gl.constexpr,
    p_layout: gl.constexpr,
):
    """Tile ``j`` (``j >= 1``; the ring's ``r``-th, its turn the ``n``-th):
    its scores and tile ``j - 1``'s ``P V`` issued together, its softmax
    while the ``P V`` runs, tile ``j - 1``'s buffer released once both are
    done, the accumulator rescaled."""
    _ready(full, r, STAGES)
    k_tile = k_smem.index(r % STAGES).permute((1, 0))
    _take_turn(turn, n, HALF, PINGPONG)
    s_token = warpgroup_mma(q_smem, k_tile, s, use_acc=False, is_async=True)
    acc_token = warpgroup_mma(p, v_smem.index((r - 1) % STAGES), acc, is_async=True)
    _pass_turn(turn, HALF, PINGPONG)
    s = warpgroup_mma_wait(1, deps=(s_token,))
    p_new, alpha, m_i, l_i = gluon_steps.softmax(
        s, m_i, l_i, q_pos, j * BLOCK_N, kv_end, qk_scale, BLOCK_N, MASK
    )
    acc, p = warpgroup_mma_wait(0, deps=(acc_token, p))
    mbarrier.arrive(empty.index((r - 1) % STAGES))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    p = gl.convert_layout(p_new.to(p.dtype), p_layout)
    return s, acc, p, m_i, l_i


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
    TILED: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,  # a program's rows: a schedule tile's
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    num_warps: gl.constexpr,
):
    # The grid as prefill_kernel's: heads fastest, the longest (last) tiles first.
    head = gl.program_id(0).to(gl.int64)
    if TILED:
        seq = gl.load(tiles_ptr + gl.program_id(1)).to(gl.int64)
        tile = gl.load(tiles_ptr + num_tiles + gl.program_id(1)).to(gl.int64)
        tile = gl.where(seq >= 0, tile, 1 << 24)  # no tile: no row, no key
        seq = gl.maximum(seq, 0)
        row0 = tile * BLOCK_M
    else:
        row0 = (gl.num_programs(1) - 1 - gl.program_id(1)).to(gl.int64) * BLOCK_M
        seq = gl.program_id(2).to(gl.int64)
    kv_head = head // num_queries_per_kv
    q_start = gl.load(query_start_loc_ptr + seq).to(gl.int64)
    q_len = gl.load(query_start_loc_ptr + seq + 1).to(gl.int64) - q_start
    seq_len = gl.load(seq_lens_ptr + seq).to(gl.int64)
    context = seq_len - q_len
    kv_end = context + gl.minimum(row0 + BLOCK_M, q_len)
    if row0 < q_len:
        dtype: gl.constexpr = query_ptr.dtype.element_ty
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2
        )
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], smem_layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=COPY_WARPS * 32)  # each copier thread
            mbarrier.init(empty.index(i), count=2)  # each computing warpgroup
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        num_kv_tiles = gl.cdiv(kv_end, BLOCK_N).to(gl.int32)
        row_table = block_table_ptr + seq * block_table_stride
        # fmt: off
        gl.warp_specialize(
            [
                (_compute_partition, (
                    query_ptr, out_ptr, k_smem, v_smem, full, empty, turn, q_start, q_len,
                    context, row0, num_kv_tiles, head, query_stride_t, query_stride_h,
                    out_stride_t, out_stride_h, qk_scale, 0, BLOCK_N, HEAD, STAGES, PINGPONG,
                )),
                (_compute_partition, (
                    query_ptr, out_ptr, k_smem, v_smem, full, empty, turn, q_start, q_len,
                    context, row0, num_kv_tiles, head, query_stride_t, query_stride_h,
                    out_stride_t, out_stride_h, qk_scale, 1, BLOCK_N, HEAD, STAGES, PINGPONG,
                )),
                (_copy_partition, (
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
        seq = gl.load(tiles_ptr + rest).to(gl.int64)
        tile = gl.load(tiles_ptr + num_tiles + rest).to(gl.int64)
        tile = gl.where(seq >= 0, tile, 1 << 24)  # no tile: no row, no key
        seq = gl.maximum(seq, 0)
        row0 = tile * BLOCK_M
    else:
        row0 = (num_row_tiles - 1 - rest % num_row_tiles).to(gl.int64) * BLOCK_M
        seq = (rest // num_row_tiles).to(gl.int64)
    q_start = gl.load(query_start_loc_ptr + seq).to(gl.int64)
    q_len = gl.load(query_start_loc_ptr + seq + 1).to(gl.int64) - q_start
    context = gl.load(seq_lens_ptr + seq).to(gl.int64) - q_len
    kv_end = context + gl.minimum(row0 + BLOCK_M, q_len)
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
    TILED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    CHUNK: gl.constexpr,
):
    """The copying warpgroup of a persistent program: every K/V tile of
    its items, in turn, through one ring (``CHUNK`` rows at a time), so
    that the next item's first tiles land while the computing warpgroups
    finish the last one's."""
    layout: gl.constexpr = gluon_steps.load_layout(HEAD, WARPS)
    ring = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        head, seq, _, _, _, _, kv_end, num_kv_tiles = _item(
            item, num_heads, num_row_tiles, tiles_ptr, num_tiles, seq_lens_ptr,
            query_start_loc_ptr, TILED, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        row_table = block_table_ptr + seq * block_table_stride
        kv_head = head // num_queries_per_kv
        for t in range(num_kv_tiles):
            slot = (ring + t) % STAGES
            mbarrier.wait(empty.index(slot), (((ring + t) // STAGES) & 1) ^ 1)
            for c in gl.static_range(BLOCK_N // CHUNK):
                _copy_rows(
                    key_cache_ptr, value_cache_ptr, k_smem.index(slot).slice(c * CHUNK, CHUNK),
                    v_smem.index(slot).slice(c * CHUNK, CHUNK), t * BLOCK_N + c * CHUNK,
                    row_table, kv_end, kv_head, cache_stride_b, cache_stride_s, cache_stride_h,
                    BLOCK_SIZE, HEAD, layout,
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
            _compute_rows(
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
    TILED: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``prefill_specialized_kernel``'s work in programs that each take
    tiles ``program_id``, ``program_id + num_programs``, ... (a
    multiprocessor's worth of programs): one ring of K/V buffers, its
    barriers set up once, the copies of the next tile's K/V under way
    while the last tile's rows finish."""
    dtype: gl.constexpr = query_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], smem_layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=COPY_WARPS * 32)  # each copier thread
        mbarrier.init(empty.index(i), count=2)  # each computing warpgroup
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
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
                cache_stride_s, cache_stride_h, TILED, BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD,
                STAGES, COPY_WARPS, COPY_ROWS,
            )),
        ],
        [4, COPY_WARPS],
        [COMPUTE_REGISTERS, COPY_REGISTERS],
    )
    # fmt: on
