"""A computing warpgroup's part of the Gluon prefill with warps of their
own (``prefill_specialized``, ``prefill_persistent``): its 64 query rows
over the K/V tiles a copying warpgroup puts in the ring, each step's
scores and the previous step's ``P V`` issued together and the softmax
beside the ``P V``; the turns two computing warpgroups may take at the
tensor cores."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pagedkv.kernels import gluon_steps

# A computing warpgroup's query rows.
HALF_ROWS = gl.constexpr(64)


@gluon.jit
def ready(full, j, STAGES: gl.constexpr):
    """Waits for K/V tile ``j``'s copies and fences them for the tensor
    cores' reads."""
    mbarrier.wait(full.index(j % STAGES), (j // STAGES) & 1)
    fence_async_shared()


@gluon.jit
def take_turn(turn, n, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """With ``PINGPONG``, waits for this warpgroup's ``n``-th turn at the
    tensor cores: the two computing warpgroups issue their products in
    alternation (the first goes first), so that one's softmax runs while
    the other's products do."""
    if PINGPONG:
        mbarrier.wait(turn.index(HALF), (n & 1) ^ (1 - HALF))


@gluon.jit
def pass_turn(turn, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """With ``PINGPONG``, hands the tensor cores to the other computing
    warpgroup once this one's products are issued."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - HALF))


@gluon.jit
def compute_rows(
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
    s_layout: gl.constexpr = gluon_steps.mma_layout(BLOCK_N, WARPS)
    o_layout: gl.constexpr = gluon_steps.mma_layout(HEAD, WARPS)
    p_layout: gl.constexpr = gluon_steps.p_layout(HEAD, WARPS)
    smem_layout: gl.constexpr = gluon_steps.shared_layout()
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

        ready(full, ring, STAGES)
        take_turn(turn, turns, HALF, PINGPONG)
        s_token = warpgroup_mma(
            q_smem, k_smem.index(ring % STAGES).permute((1, 0)), s, use_acc=False, is_async=True
        )
        pass_turn(turn, HALF, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s_token,))
        p, _, m_i, l_i = gluon_steps.softmax(s, m_i, l_i, q_pos, 0, kv_end, qk_scale, BLOCK_N, True)
        p = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, diagonal):
            s, acc, p, m_i, l_i = rows_step(
                j, ring + j, turns + j, s, acc, p, m_i, l_i, q_smem, k_smem, v_smem, full,
                empty, turn, q_pos, kv_end, qk_scale, HALF, BLOCK_N, STAGES, False, PINGPONG,
                p_layout,
            )  # fmt: skip
        for j in range(gl.maximum(diagonal, 1), my_tiles):
            s, acc, p, m_i, l_i = rows_step(
                j, ring + j, turns + j, s, acc, p, m_i, l_i, q_smem, k_smem, v_smem, full,
                empty, turn, q_pos, kv_end, qk_scale, HALF, BLOCK_N, STAGES, True, PINGPONG,
                p_layout,
            )  # fmt: skip
        last = ring + my_tiles - 1
        take_turn(turn, turns + my_tiles, HALF, PINGPONG)
        acc_token = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        pass_turn(turn, HALF, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(acc_token,))
        mbarrier.arrive(empty.index(last % STAGES))

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        out = gl.convert_layout(out.to(dtype), load_layout)
        out_offsets = (q_start + rows)[:, None] * out_stride_t + head * out_stride_h + dims[None, :]
        gl.store(out_ptr + out_offsets, out, mask=row_mask)
    else:  # no rows: the turn the first tile's scores would take
        take_turn(turn, turns, HALF, PINGPONG)
        pass_turn(turn, HALF, PINGPONG)
    # The other warpgroup's last tiles, a turn each: both take
    # num_kv_tiles + 1 turns.
    for j in range(my_tiles, num_kv_tiles):
        mbarrier.wait(full.index((ring + j) % STAGES), ((ring + j) // STAGES) & 1)
        mbarrier.arrive(empty.index((ring + j) % STAGES))
        take_turn(turn, turns + j + 1, HALF, PINGPONG)
        pass_turn(turn, HALF, PINGPONG)


@gluon.jit
def rows_step(
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
    ready(full, r, STAGES)
    k_tile = k_smem.index(r % STAGES).permute((1, 0))
    take_turn(turn, n, HALF, PINGPONG)
    s_token = warpgroup_mma(q_smem, k_tile, s, use_acc=False, is_async=True)
    acc_token = warpgroup_mma(p, v_smem.index((r - 1) % STAGES), acc, is_async=True)
    pass_turn(turn, HALF, PINGPONG)
    s = warpgroup_mma_wait(1, deps=(s_token,))
    p_new, alpha, m_i, l_i = gluon_steps.softmax(
        s, m_i, l_i, q_pos, j * BLOCK_N, kv_end, qk_scale, BLOCK_N, MASK
    )
    acc, p = warpgroup_mma_wait(0, deps=(acc_token, p))
    mbarrier.arrive(empty.index((r - 1) % STAGES))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    p = gl.convert_layout(p_new.to(p.dtype), p_layout)
    return s, acc, p, m_i, l_i
