"""The prefill for sm_90 (H100, H200) written in Gluon, Triton's lower
level, where the kernel states the order of its work itself: which
products each warpgroup issues on the tensor cores asynchronously, and
what it computes while they run (``TILING``'s schedules). Each issues
tile j's scores (``Q K^T``) and tile j - 1's ``P V`` together and
computes tile j's softmax while the ``P V`` runs (schedule 1; schedule 2
issues tile j + 1's scores before tile j's softmax). Schedules 3 to 8
run this in warps of their own (``prefill_specialized``): two
warpgroups compute, each at its own pace, and a third gathers the K/V
pages through the block table into a ring of shared-memory buffers, by
``cp.async`` or, a page a copy, by the Tensor Memory Accelerator; by
default at head size 128 (schedule 8) in persistent programs, one a
multiprocessor, each taking tiles in turn (``prefill_persistent``).
Schedules 0 to 2 have every warpgroup copy, then meet at a barrier each
step. Triton's compiler, given the same loop
(``prefill_kernel``), runs dot, softmax, dot in order within a warpgroup.
No accumulator is read while a product that writes it may be in flight:
ptxas would then serialize every product of the kernel (its note C7514).

It covers the prefill's common case: a float16 or bfloat16 cache, head
size 64 or 128, causal attention with no window or soft-cap, 128 or 64
query rows a program (two warpgroups of 64, or one) and the same tile
schedule as ``prefill_kernel`` (a decode entry is a tile of one row).
``supported`` says when it applies; ``paged_attention`` launches it (on
by default: ``PREFILL_GLUON``). It has no interpreter: its tests run on a
GPU, and its sm_90 build on any machine (tests/kernels/sm90_compile.py).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pagedkv.kernels import gluon_steps, prefill_persistent, prefill_specialized
from pagedkv.kernels.gluon_steps import MASKED

LOG2E = 1.4426950408889634
# Query rows of a tile of ``paged_attention``'s schedule (``tile_rows``).
TILE_ROWS = 128
# Keys a tile, buffers of the K/V ring, the schedule and query rows a
# program (128: two warpgroups; 64: one, two programs a schedule tile), by
# head size. The schedules: 0, in turn (a tile's P V, the next tile's
# scores, their softmax); 1, a tile's scores and the previous tile's P V
# issued together, the softmax beside the P V; 2, tile j + 1's scores
# issued before tile j's softmax, which runs beside them and tile j - 1's
# P V (at least 4 buffers); 3, schedule 1 in warps of their own
# (prefill_specialized: two computing warpgroups, each at its own pace,
# and a copying one; 128 rows, at least 2 buffers); 4, the same with the
# computing warpgroups taking turns at the tensor cores; 5, schedule 3 in
# persistent programs, one a multiprocessor, each taking tiles in turn;
# 6, 7 and 8, schedules 3, 4 and 5 with the pages
# copied by the Tensor Memory Accelerator (a copy a page; where the cache's
# layout allows, else by cp.async: _page_descriptors). On an H100 at
# head size 128, b = 8 (kernels-prefill-tune-bfloat16-specialized-h100.json;
# 2,048 new tokens, then 512 over 4,096 cached): (64, 4, 3, 128) 684 and
# 609 us, (64, 4, 4, 128) 687 and 603, (64, 4, 1, 128) 821 and 715, the
# Triton kernel 779 and 722. On an H200
# (kernels-prefill-tune-bfloat16-specialized-h200.json) (128, 3, 3, 128)
# took 700 and 579 against 687 and 615 for (64, 4, 3, 128). On an H100
# (kernels-prefill-tune-bfloat16-tma-h100.json; the same shapes, cuDNN
# 505 us at the first): (64, 4, 3, 128) 683 and 605 us, (64, 4, 6, 128)
# 640 and 560, (64, 4, 5, 128) 635 and 603, (64, 4, 8, 128) 588 and 552
# (467 TFLOP/s, 0.86x cuDNN's speed), the Triton kernel 781 and 715. At
# head size 64 (kernels-prefill-tune-bfloat16-tma-64-h100.json; cuDNN 353
# us at the first): (64, 4, 3, 128) 486 and 427 us, (64, 4, 6, 128) 485
# and 422, (64, 4, 8, 128) 456 and 433, the Triton kernel 530 and 511.
TILING = {64: (64, 4, 8, 128), 128: (64, 4, 8, 128)}
# The ring buffers' layout, as the page descriptors give it to the copies:
# built once, since calling the constexpr function from the host costs
# more than the descriptors themselves (a launch of schedules 6 to 8 a layer).
_PAGE_LAYOUT = gluon_steps.shared_layout()


def supported(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
) -> bool:
    """Whether this kernel computes the batch: on an sm_90 GPU, a float16 or
    bfloat16 query and cache of the same dtype, head size 64 or 128, no
    window or soft-cap."""
    return key_cache.dtype == query.dtype and supports_query(query, sliding_window, softcap)


def supports_query(query: torch.Tensor, sliding_window: int | None, softcap: float | None) -> bool:
    """``supported`` over a cache of the query's dtype (what
    ``dequant_blocks`` makes of a quantized one)."""
    return (
        runs_on(query.device)
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] in TILING
        and sliding_window is None
        and softcap is None
    )


def runs_on(device: torch.device) -> bool:
    """Whether ``device`` runs this kernel: an sm_90 GPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


@gluon.jit
def _prefill_kernel(
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
    ROWS: gl.constexpr,  # a schedule tile's query rows
    BLOCK_M: gl.constexpr,  # a program's (a part of ROWS)
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    STAGES: gl.constexpr,
    SCHEDULE: gl.constexpr,
    num_warps: gl.constexpr,
):
    # The grid as prefill_kernel's: heads fastest, the longest (last) tiles first.
    head = gl.program_id(0).to(gl.int64)
    if TILED:  # ROWS // BLOCK_M programs a schedule tile
        entry = gl.program_id(1) // (ROWS // BLOCK_M)
        seq = gl.load(tiles_ptr + entry).to(gl.int64)
        tile = gl.load(tiles_ptr + num_tiles + entry).to(gl.int64)
        tile = gl.where(seq >= 0, tile, 1 << 24)  # no tile: no row, no key
        seq = gl.maximum(seq, 0)
        row0 = tile * ROWS + (gl.program_id(1) % (ROWS // BLOCK_M)) * BLOCK_M
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
        load_layout: gl.constexpr = gluon_steps.load_layout(HEAD, num_warps)
        s_layout: gl.constexpr = gluon_steps.mma_layout(BLOCK_N, num_warps)
        o_layout: gl.constexpr = gluon_steps.mma_layout(HEAD, num_warps)
        p_layout: gl.constexpr = gluon_steps.p_layout(HEAD, num_warps)
        smem_layout: gl.constexpr = gluon_steps.shared_layout()

        # Q into shared memory, the scores' left operand.
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load_layout))
        dims = gl.arange(0, HEAD, layout=gl.SliceLayout(0, load_layout))
        row_mask = (rows < q_len)[:, None] & (dims < HEAD)[None, :]
        q_offsets = (
            (q_start + rows)[:, None] * query_stride_t + head * query_stride_h + dims[None, :]
        )
        q = gl.load(query_ptr + q_offsets, mask=row_mask, other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], smem_layout, q)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], smem_layout)

        # Keys before the tile's first query (rounded down to BLOCK_N) are
        # seen by every row: tiles before ``diagonal`` need no mask.
        num_kv_tiles = gl.cdiv(kv_end, BLOCK_N).to(gl.int32)
        diagonal = gl.minimum((context + row0) // BLOCK_N, num_kv_tiles).to(gl.int32)
        row_table = block_table_ptr + seq * block_table_stride
        pages = gluon_steps.gather_pages(row_table, 0, kv_end, BLOCK_N, BLOCK_SIZE, load_layout)
        # Tiles issued before the loop: STAGES - 1 in turn (SCHEDULE 0 and
        # 1), STAGES - 2 with the scores a tile ahead (2).
        AHEAD: gl.constexpr = SCHEDULE == 2
        FIRST: gl.constexpr = STAGES - 2 if AHEAD else STAGES - 1
        for t in gl.static_range(FIRST):
            pages = gluon_steps.issue_tile(
                key_cache_ptr, value_cache_ptr, k_smem, v_smem, pages, t, row_table, kv_end,
                kv_head, cache_stride_b, cache_stride_s, cache_stride_h, BLOCK_N, BLOCK_SIZE,
                HEAD, STAGES, load_layout,
            )  # fmt: skip

        q_pos = context + row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([BLOCK_M], MASKED, gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=o_layout)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        # Tile 0's scores, alone.
        async_copy.wait_group(FIRST - 1)
        fence_async_shared()
        gluon_steps.cta_barrier()
        s_token = warpgroup_mma(
            q_smem, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True
        )
        s = warpgroup_mma_wait(0, deps=(s_token,))
        if AHEAD:
            # Tile j + 1's scores run beside tile j's softmax. The last tile
            # is always masked (it holds the last query's own key).
            p = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=p_layout)
            acc_token = warpgroup_mma_init(acc)
            last = num_kv_tiles - 1
            for j in range(0, gl.minimum(diagonal, last)):
                s, acc_token, p, m_i, l_i, pages = gluon_steps.step_ahead(
                    j, s, acc_token, p, m_i, l_i, pages, q_smem, k_smem, v_smem,
                    key_cache_ptr, value_cache_ptr, q_pos, row_table, kv_end, kv_head,
                    cache_stride_b, cache_stride_s, cache_stride_h, qk_scale, BLOCK_N,
                    BLOCK_SIZE, HEAD, STAGES, False, True, load_layout, p_layout,
                )  # fmt: skip
            for j in range(gl.minimum(diagonal, last), last):
                s, acc_token, p, m_i, l_i, pages = gluon_steps.step_ahead(
                    j, s, acc_token, p, m_i, l_i, pages, q_smem, k_smem, v_smem,
                    key_cache_ptr, value_cache_ptr, q_pos, row_table, kv_end, kv_head,
                    cache_stride_b, cache_stride_s, cache_stride_h, qk_scale, BLOCK_N,
                    BLOCK_SIZE, HEAD, STAGES, True, True, load_layout, p_layout,
                )  # fmt: skip
            s, acc_token, p, m_i, l_i, pages = gluon_steps.step_ahead(
                last, s, acc_token, p, m_i, l_i, pages, q_smem, k_smem, v_smem,
                key_cache_ptr, value_cache_ptr, q_pos, row_table, kv_end, kv_head,
                cache_stride_b, cache_stride_s, cache_stride_h, qk_scale, BLOCK_N,
                BLOCK_SIZE, HEAD, STAGES, True, False, load_layout, p_layout,
            )  # fmt: skip
            acc, p = warpgroup_mma_wait(0, deps=(acc_token, p))
        else:
            # Tile 0's P V goes with tile 1's scores.
            p, _, m_i, l_i = gluon_steps.softmax(
                s, m_i, l_i, q_pos, 0, kv_end, qk_scale, BLOCK_N, True
            )
            p = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, diagonal):
                s, acc, p, m_i, l_i, pages = gluon_steps.step(
                    j, s, acc, p, m_i, l_i, pages, q_smem, k_smem, v_smem, key_cache_ptr,
                    value_cache_ptr, q_pos, row_table, kv_end, kv_head, cache_stride_b,
                    cache_stride_s, cache_stride_h, qk_scale, BLOCK_N, BLOCK_SIZE, HEAD,
                    STAGES, False, SCHEDULE == 1, load_layout, p_layout,
                )  # fmt: skip
            for j in range(gl.maximum(diagonal, 1), num_kv_tiles):
                s, acc, p, m_i, l_i, pages = gluon_steps.step(
                    j, s, acc, p, m_i, l_i, pages, q_smem, k_smem, v_smem, key_cache_ptr,
                    value_cache_ptr, q_pos, row_table, kv_end, kv_head, cache_stride_b,
                    cache_stride_s, cache_stride_h, qk_scale, BLOCK_N, BLOCK_SIZE, HEAD,
                    STAGES, True, SCHEDULE == 1, load_layout, p_layout,
                )  # fmt: skip
            # The last tile's P V.
            last = num_kv_tiles - 1
            acc_token = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc_token,))
        async_copy.wait_group(0)  # the copies past the last tile (all masked)

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        out = gl.convert_layout(out.to(dtype), load_layout)
        out_offsets = (q_start + rows)[:, None] * out_stride_t + head * out_stride_h + dims[None, :]
        gl.store(out_ptr + out_offsets, out, mask=row_mask)


def prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    max_query_len: int,
    tiles: torch.Tensor | None,
) -> None:
    """Launches the kernel over a batch ``supported`` accepts, into ``out``
    (the arguments as ``paged_attention``'s, checked there)."""
    num_q_heads, head_size = query.shape[1:]
    block_n, stages, schedule, block_m = TILING[head_size]
    if schedule == 2 and stages < 4:
        raise ValueError(f"TILING: the scores a tile ahead need 4 buffers or more, not {stages}")
    specialized = schedule >= 3
    if specialized and block_m != TILE_ROWS:
        raise ValueError(f"TILING: schedule {schedule} takes {TILE_ROWS} rows a program")
    if tiles is not None:
        grid: tuple[int, ...] = (num_q_heads, tiles.shape[1] * (TILE_ROWS // block_m), 1)
    else:
        grid = (num_q_heads, triton.cdiv(max_query_len, block_m), len(seq_lens))
    args = (
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        tiles if tiles is not None else query_start_loc,
        out,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        scale * LOG2E,
        num_q_heads // key_cache.shape[2],
        tiles.shape[1] if tiles is not None else 0,
    )
    shape = {
        "TILED": tiles is not None,
        "BLOCK_SIZE": key_cache.shape[1],
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "HEAD": head_size,
        "STAGES": stages,
    }
    descriptors = _page_descriptors(key_cache, value_cache) if schedule >= 6 else None
    if schedule in (5, 8):  # programs that each take tiles in turn
        row_tiles = grid[1] if tiles is None else 0
        items = grid[0] * grid[1] * grid[2]
        prefill_persistent.prefill_persistent_kernel[(min(items, _programs(query)),)](
            *args,
            num_q_heads,
            row_tiles,
            items,
            *(descriptors or (key_cache, value_cache)),
            **shape,
            PINGPONG=False,
            TMA=descriptors is not None,
            num_warps=4,  # the first computing warpgroup; the others are its partitions
            maxnreg=prefill_specialized.KERNEL_REGISTERS,
        )
    elif specialized:  # two computing warpgroups and a copying one
        prefill_specialized.prefill_specialized_kernel[grid](
            *args,
            *(descriptors or (key_cache, value_cache)),
            **shape,
            PINGPONG=schedule in (4, 7),
            TMA=descriptors is not None,
            num_warps=4,  # the first computing warpgroup; the others are its partitions
            maxnreg=prefill_specialized.KERNEL_REGISTERS,
        )
    else:
        _prefill_kernel[grid](
            *args,
            **shape,
            ROWS=TILE_ROWS,
            SCHEDULE=schedule,
            num_warps=block_m // 16,  # four a warpgroup of 64 rows
        )


def _page_descriptors(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Tensor descriptors of the caches viewed as ``[num_blocks *
    block_size, num_kv_heads * head_size]``, a block's rows of one KV head
    a copy, for schedules 6 to 8; None where that view does not hold (a
    cache whose block, slot and head are not laid out in that order) or a
    page's rows would not start on a swizzle row group (block sizes other
    than multiples of 8): then the copier takes ``cp.async``."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    rows = (num_blocks * block_size, num_kv_heads * head_size)
    block = [min(block_size, TILING[head_size][0]), head_size]
    descriptors = []
    for cache in (key_cache, value_cache):
        stride_b, stride_s, stride_h, stride_d = cache.stride()
        if (
            block_size % 8
            or stride_d != 1
            or stride_h != head_size
            or stride_s != num_kv_heads * head_size
            or stride_b != block_size * stride_s
            or cache.data_ptr() % 16
            or rows[0] >= 2**31
        ):
            return None
        descriptors.append(TensorDescriptor(cache, list(rows), [stride_s, 1], block, _PAGE_LAYOUT))
    return descriptors[0], descriptors[1]


def _programs(query: torch.Tensor) -> int:
    """A persistent launch's programs: one a multiprocessor (132 where
    the kernel is only built, off a GPU)."""
    if not query.is_cuda:
        return 132
    return _multiprocessors(query.device.index or 0)


@functools.cache
def _multiprocessors(device: int) -> int:
    """The GPU's multiprocessors, asked once a device (a launch happens a
    layer a step)."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
