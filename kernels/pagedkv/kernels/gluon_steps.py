"""The steps of the Gluon prefill's loop (``prefill_gluon``): a K/V tile's
copies through the block table into the ring of shared-memory buffers
(whole, or some rows of it: ``copy_rows``), one tile's softmax, and one
step of schedules 0 to 2 (which products a warpgroup issues on the tensor
cores, and what it computes while they run); and the layouts that every
Gluon program of the prefill shares."""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Triton 3.7 names the CTA-wide barrier ``barrier``; 3.6 ``thread_barrier``.
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# A score no real one reaches; finite so that exp2 never sees inf - inf.
MASKED = gl.constexpr(-1.0e30)


@triton.constexpr_function
def load_layout(head_size, num_warps):
    """Rows of ``head_size`` values, eight (16 bytes) a thread."""
    across = head_size // 8
    return gl.BlockedLayout([1, 8], [32 // across, across], [num_warps, 1], [1, 0])


@triton.constexpr_function
def mma_layout(columns, num_warps):
    """A warpgroup product's result of ``columns`` columns in registers:
    the scores (``BLOCK_N``) or the output (``HEAD``)."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, columns, 16]
    )


@triton.constexpr_function
def p_layout(head_size, num_warps):
    """The softmax weights as ``P V``'s left operand, in registers."""
    return gl.DotOperandLayout(operand_index=0, parent=mma_layout(head_size, num_warps), k_width=2)


@triton.constexpr_function
def shared_layout():
    """Q and the K/V buffers in shared memory, as the tensor cores read
    them: 16-bit values, 128-byte swizzle."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.jit
def gather_pages(
    row_table, start, kv_end, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, layout: gl.constexpr
):
    """The pages of keys ``start .. start + BLOCK_N - 1`` (0 past ``kv_end``)."""
    k_pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    return gl.load(row_table + k_pos // BLOCK_SIZE, mask=k_pos < kv_end, other=0).to(gl.int64)


@gluon.jit
def issue_tile(
    key_cache_ptr,
    value_cache_ptr,
    k_smem,
    v_smem,
    pages,
    tile,
    row_table,
    kv_end,
    kv_head,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    layout: gl.constexpr,
):
    """Starts the copies of K/V tile ``tile`` (its ``pages``, read a tile
    ahead) into its ring buffer as one group (rows past ``kv_end`` zeroed),
    and returns the next tile's pages."""
    start = tile * BLOCK_N
    k_pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    slot = tile % STAGES
    _copy_pages(
        key_cache_ptr, value_cache_ptr, k_smem.index(slot), v_smem.index(slot), pages, k_pos,
        kv_end, kv_head, cache_stride_b, cache_stride_s, cache_stride_h, BLOCK_SIZE, HEAD, layout,
    )  # fmt: skip
    async_copy.commit_group()
    return gather_pages(row_table, start + BLOCK_N, kv_end, BLOCK_N, BLOCK_SIZE, layout)


@gluon.jit
def softmax(s, m_i, l_i, q_pos, start, kv_end, qk_scale, BLOCK_N: gl.constexpr, MASK: gl.constexpr):
    """One tile's scores to softmax weights (base 2) beside the running max
    and sum; returns the weights, the factor that rescales the earlier
    tiles' sums, and the new max and sum. ``MASK`` off promises a tile
    every row sees in whole."""
    if MASK:
        k_pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < kv_end)[None, :]
        scores = gl.where(allowed, s * qk_scale, MASKED)
        m_new = gl.maximum(m_i, gl.max(scores, 1))
        p = gl.exp2(scores - m_new[:, None])
    else:  # the scale inside exp2's argument: one fused multiply-add a score
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def step(
    j,
    s,
    acc,
    p,
    m_i,
    l_i,
    pages,
    q_smem,
    k_smem,
    v_smem,
    key_cache_ptr,
    value_cache_ptr,
    q_pos,
    row_table,
    kv_end,
    kv_head,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    qk_scale,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    MASK: gl.constexpr,
    OVERLAP: gl.constexpr,
    load_layout: gl.constexpr,
    p_layout: gl.constexpr,
):
    """Tile ``j`` (``j >= 1``): its scores issued, then tile ``j - 1``'s
    ``P V``; its softmax while that product runs; the accumulator rescaled
    once the product is done. Without ``OVERLAP`` each waits for the one
    before (to measure what the overlap buys)."""
    async_copy.wait_group(STAGES - 3)  # tile j's copies (this thread's)
    fence_async_shared()  # visible to the tensor cores' reads
    cta_barrier()  # every thread's copies; every warpgroup past tile j - 2's P V
    pages = issue_tile(
        key_cache_ptr, value_cache_ptr, k_smem, v_smem, pages, j + STAGES - 2, row_table, kv_end,
        kv_head, cache_stride_b, cache_stride_s, cache_stride_h, BLOCK_N, BLOCK_SIZE, HEAD, STAGES,
        load_layout,
    )  # fmt: skip
    k_tile = k_smem.index(j % STAGES).permute((1, 0))
    if OVERLAP:
        s_token = warpgroup_mma(q_smem, k_tile, s, use_acc=False, is_async=True)
        acc_token = warpgroup_mma(p, v_smem.index((j - 1) % STAGES), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_token,))
        p_new, alpha, m_i, l_i = softmax(
            s, m_i, l_i, q_pos, j * BLOCK_N, kv_end, qk_scale, BLOCK_N, MASK
        )
        acc, p = warpgroup_mma_wait(0, deps=(acc_token, p))
    else:  # in turn: P V, the scores, their softmax
        acc_token = warpgroup_mma(p, v_smem.index((j - 1) % STAGES), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=(acc_token, p))
        s_token = warpgroup_mma(q_smem, k_tile, s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_token,))
        p_new, alpha, m_i, l_i = softmax(
            s, m_i, l_i, q_pos, j * BLOCK_N, kv_end, qk_scale, BLOCK_N, MASK
        )
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    p = gl.convert_layout(p_new.to(p.dtype), p_layout)
    return s, acc, p, m_i, l_i, pages


@gluon.jit
def step_ahead(
    j,
    s,
    acc_token,
    p,
    m_i,
    l_i,
    pages,
    q_smem,
    k_smem,
    v_smem,
    key_cache_ptr,
    value_cache_ptr,
    q_pos,
    row_table,
    kv_end,
    kv_head,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    qk_scale,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    MASK: gl.constexpr,
    NEXT: gl.constexpr,
    load_layout: gl.constexpr,
    p_layout: gl.constexpr,
):
    """Tile ``j``, whose scores ``s`` are done, with tile ``j - 1``'s ``P V``
    in flight (``acc_token``, its weights ``p``): tile ``j + 1``'s scores
    issued (``NEXT``), tile ``j``'s softmax while they and that ``P V``
    run, the accumulator rescaled once the ``P V`` is done, then tile
    ``j``'s ``P V`` issued; returns with tile ``j + 1``'s scores done and
    tile ``j``'s ``P V`` in flight."""
    if NEXT:
        async_copy.wait_group(STAGES - 4)  # tile j + 1's copies (this thread's)
        fence_async_shared()  # visible to the tensor cores' reads
        cta_barrier()  # every thread's copies; every warpgroup past tile j - 2's P V
        pages = issue_tile(
            key_cache_ptr, value_cache_ptr, k_smem, v_smem, pages, j + STAGES - 2, row_table,
            kv_end, kv_head, cache_stride_b, cache_stride_s, cache_stride_h, BLOCK_N,
            BLOCK_SIZE, HEAD, STAGES, load_layout,
        )  # fmt: skip
        k_next = k_smem.index((j + 1) % STAGES).permute((1, 0))
        s_token = warpgroup_mma(q_smem, k_next, gl.zeros_like(s), use_acc=False, is_async=True)
    p_new, alpha, m_i, l_i = softmax(
        s, m_i, l_i, q_pos, j * BLOCK_N, kv_end, qk_scale, BLOCK_N, MASK
    )
    # Both products done: no accumulator is read while a product is in
    # flight (where ptxas would serialize every product).
    if NEXT:
        s, acc, p = warpgroup_mma_wait(0, deps=(s_token, acc_token, p))
    else:
        acc, p = warpgroup_mma_wait(0, deps=(acc_token, p))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    p = gl.convert_layout(p_new.to(p.dtype), p_layout)
    acc_token = warpgroup_mma(p, v_smem.index(j % STAGES), acc, is_async=True)
    return s, acc_token, p, m_i, l_i, pages


@gluon.jit
def copy_rows(
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
    CHUNK: gl.constexpr,
    layout: gl.constexpr,
):
    """Starts the copies of keys and values ``start`` onwards into
    ``k_rows`` and ``v_rows`` (rows past ``kv_end`` zeroed), ``CHUNK``
    rows at a time, each chunk's pages read from the block table first."""
    for c in gl.static_range(k_rows.shape[0] // CHUNK):
        k_pos = start + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        pages = gl.load(row_table + k_pos // BLOCK_SIZE, mask=k_pos < kv_end, other=0)
        _copy_pages(
            key_cache_ptr, value_cache_ptr, k_rows.slice(c * CHUNK, CHUNK),
            v_rows.slice(c * CHUNK, CHUNK), pages.to(gl.int64), k_pos, kv_end, kv_head,
            cache_stride_b, cache_stride_s, cache_stride_h, BLOCK_SIZE, HEAD, layout,
        )  # fmt: skip


@gluon.jit
def _copy_pages(
    key_cache_ptr,
    value_cache_ptr,
    k_rows,
    v_rows,
    pages,
    k_pos,
    kv_end,
    kv_head,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    BLOCK_SIZE: gl.constexpr,
    HEAD: gl.constexpr,
    layout: gl.constexpr,
):
    """Starts the copies of the keys and values at positions ``k_pos``
    (on ``pages``) into ``k_rows`` and ``v_rows``, rows past ``kv_end``
    zeroed."""
    rows = pages * cache_stride_b + (k_pos % BLOCK_SIZE) * cache_stride_s + kv_head * cache_stride_h
    dims = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
    offsets = rows[:, None] + dims[None, :]
    mask = (k_pos < kv_end)[:, None] & (dims < HEAD)[None, :]
    async_copy.async_copy_global_to_shared(k_rows, key_cache_ptr + offsets, mask=mask)
    async_copy.async_copy_global_to_shared(v_rows, value_cache_ptr + offsets, mask=mask)
