"""Triton paged attention over a packed varlen batch (prefill chunks and decodes).

One program computes ``BLOCK_M`` query tokens of one sequence for one query
head, streaming that sequence's K/V page by page through its block table with
an online softmax (flash-attention tiling). Causal masking is bottom-right
aligned: query token j of a sequence with ``seq_len`` tokens and ``q_len``
new ones is at position ``seq_len - q_len + j``. Oracle:
``reference.paged_attention``.

Batches of decodes take a flash-decoding path (split-K over the context,
query heads of a KV head together). Launch constants come from
``python -m pagedkv.kernels.tune`` on the H200.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import check_attention_args

# A score no real one reaches; finite so that exp() never sees inf - inf.
_MASKED = tl.constexpr(-1.0e30)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_tile(
    ptrs,  # [BLOCK_N, BLOCK_D] pointers into a K or V cache
    row_valid,  # [BLOCK_N]
    dim_valid,  # [BLOCK_D]
    ROW_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """One K or V tile; masks only what may be out of range (rows past the
    keys when ``ROW_MASK``, padded dims unless ``EVEN_D``)."""
    if ROW_MASK:
        tile = tl.load(ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=dim_valid[None, :], other=0.0)
    return tile


@triton.jit
def _attend(
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
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    MASK: tl.constexpr,
):
    """Online softmax of the rows over keys ``kv_start .. kv_end - 1`` of one
    sequence's KV head, read ``BLOCK_N`` at a time through its block table.
    ``MASK`` off promises full tiles that every row sees in whole (below the
    causal diagonal, no window): no load or score masks then. Scores are kept
    in base 2."""
    for start in range(kv_start, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        table = block_table_ptr + seq * block_table_stride + k_pos // BLOCK_SIZE
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
        k = _load_tile(key_cache_ptr + kv_ptrs, k_valid, dim_valid, MASK, EVEN_D)
        qk = tl.dot(q, tl.trans(k))
        if USE_SOFTCAP:
            scores = qk * scale
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0) * _LOG2E
        else:
            scores = qk * (scale * _LOG2E)  # softmax in base 2: exp2 is one instruction
        if MASK:
            allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            scores = tl.where(allowed, scores, _MASKED)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(value_cache_ptr + kv_ptrs, k_valid, dim_valid, MASK, EVEN_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
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
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    # Heads vary fastest, so the query heads of a KV head run side by side and
    # share its K/V in L2; the last (longest, causal) tiles start first.
    head = tl.program_id(0).to(tl.int64)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    kv_head = head // num_queries_per_kv

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context = seq_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    q_pos = context + rows
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    q_offsets = (q_start + rows)[:, None] * query_stride_t + head * query_stride_h + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Keys this tile reads: up to its last query's position, from the first
    # key its first query's window reaches (a multiple of BLOCK_N).
    kv_end = context + tl.minimum((tile + 1) * BLOCK_M, q_len)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)
    kv_start = kv_end * 0
    if USE_WINDOW:
        kv_start = tl.maximum(context + tile * BLOCK_M - sliding_window + 1, 0)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], _MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys before the tile's first query (rounded down to BLOCK_N) are seen by
    # every row: no mask there. With a window every key is masked (the
    # unmasked range is empty).
    diagonal = kv_start
    if not USE_WINDOW:
        diagonal = tl.minimum(((context + tile * BLOCK_M) // BLOCK_N) * BLOCK_N, kv_end)
    m_i, l_i, acc = _attend(
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
        USE_WINDOW,
        USE_SOFTCAP,
        BLOCK_SIZE,
        BLOCK_N,
        EVEN_D,
        False,
    )
    m_i, l_i, acc = _attend(
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
        USE_WINDOW,
        USE_SOFTCAP,
        BLOCK_SIZE,
        BLOCK_N,
        EVEN_D,
        True,
    )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # l_i is 0 only in rows not stored
    out_offsets = (q_start + rows)[:, None] * out_stride_t + head * out_stride_h + dims[None, :]
    tl.store(
        out_ptr + out_offsets,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


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
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Flash-decoding: one (sequence, KV head, split of the context) per
    program; the query heads sharing the KV head are the rows, so each K/V
    byte is read once for all of them. With ``SPLIT`` each program stores its
    partial output and log-sum-exp for ``_decode_merge_kernel``; without,
    there is one split and the program stores the output."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    q_pos = seq_len - 1

    groups = tl.arange(0, BLOCK_G)
    group_valid = groups < num_queries_per_kv
    heads = kv_head * num_queries_per_kv + groups
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    q = tl.load(
        query_ptr + seq * query_stride_t + heads[:, None] * query_stride_h + dims[None, :],
        mask=group_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Each sequence's own context is split (in whole steps), so a launch sized
    # for a longer bound (a CUDA graph's) still spreads a short one out.
    split_size = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)
    if USE_WINDOW:
        first = tl.maximum(q_pos - sliding_window + 1, 0)
        start = tl.maximum(start, (first // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_G], _MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    q_pos_rows = tl.zeros([BLOCK_G], dtype=tl.int64) + q_pos
    # Whole tiles need no mask (every key is at or before the query); the
    # last, partial one does, and so does every tile under a window.
    full_end = start
    if not USE_WINDOW:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend(
        q,
        q_pos_rows,
        m_i,
        l_i,
        acc,
        start,
        full_end,
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
        USE_WINDOW,
        USE_SOFTCAP,
        BLOCK_SIZE,
        BLOCK_N,
        EVEN_D,
        False,
    )
    m_i, l_i, acc = _attend(
        q,
        q_pos_rows,
        m_i,
        l_i,
        acc,
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
        scale,
        softcap,
        sliding_window,
        dims,
        dim_valid,
        USE_WINDOW,
        USE_SOFTCAP,
        BLOCK_SIZE,
        BLOCK_N,
        EVEN_D,
        True,
    )

    if SPLIT:
        # An empty split (past the sequence, or before its window) has l_i == 0.
        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), _MASKED)  # base 2
        row = (seq * num_q_heads + heads) * num_splits + split
        tl.store(
            partial_out_ptr + row[:, None] * head_size + dims[None, :],
            out,
            mask=group_valid[:, None] & dim_valid[None, :],
        )
        tl.store(partial_lse_ptr + row, lse, mask=group_valid)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=group_valid[:, None] & dim_valid[None, :],
        )


@triton.jit
def _decode_merge_kernel(
    partial_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_size], float32
    partial_lse_ptr,  # [num_seqs, num_q_heads, num_splits], float32
    out_ptr,  # [num_seqs, num_q_heads, head_size]
    out_stride_t,
    out_stride_h,
    num_q_heads,
    num_splits,
    head_size,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Flash-decoding, second pass: one program per (sequence, query head,
    ``BLOCK_D`` dims) weighs its splits' outputs by their sums, all
    ``num_splits <= BLOCK_S`` splits in one load."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    row = (seq * num_q_heads + head) * num_splits
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < num_splits
    lse = tl.load(partial_lse_ptr + row + splits, mask=split_valid, other=_MASKED)
    weights = tl.exp2(lse - tl.max(lse, 0))  # 0 for empty splits
    parts = tl.load(
        partial_out_ptr + (row + splits)[:, None] * head_size + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + seq * out_stride_t + head * out_stride_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


# Prefill tiling: (query rows, keys per step, warps, pipeline stages); the
# best of a first sweep on the H200 at head size 128, and a smaller one for
# larger heads (shared memory).
PREFILL_TILE = (128, 128, 8, 2)
PREFILL_TILE_LARGE_HEAD = (32, 64, 4, 2)

# Decode tuning, from ``python -m pagedkv.kernels.tune`` on the H200 (results
# in tests/benchmarks/results/kernels-tune-h200.json). DECODE_TILE: keys per
# step, warps and pipeline stages. DECODE_PROGRAMS_PER_SM: how many of those
# programs a multiprocessor holds at once (at head size 128 registers allow
# 4); the context is split into as many pieces as fill that in one wave, as
# a second, partial wave would leave most of the GPU idle. A split takes at
# least DECODE_MIN_STEPS_PER_SPLIT steps.
DECODE_TILE = (64, 4, 2)
DECODE_PROGRAMS_PER_SM = 4
DECODE_MAX_SPLITS = 256
DECODE_MIN_STEPS_PER_SPLIT = 1
# The merge kernel's load per program: about DECODE_MERGE_ELEMENTS partial
# values (splits x dims), at least DECODE_MERGE_MIN_DIMS dims: a long split
# list is spread over more programs, a short one kept whole (on the H200,
# 32-dim slices were the fastest with tens of splits, whole heads with two).
DECODE_MERGE_ELEMENTS = 4096
DECODE_MERGE_MIN_DIMS = 32


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (8 for the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _num_splits(num_pairs: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Splits of each (sequence, KV head)'s context: as many as the GPU holds
    programs in one wave, and no more than the longest context has steps."""
    wanted = DECODE_PROGRAMS_PER_SM * num_sms // num_pairs
    longest = triton.cdiv(max_seq_len, DECODE_MIN_STEPS_PER_SPLIT * block_n)
    return int(max(1, min(wanted, longest, DECODE_MAX_SPLITS)))


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    max_seq_len: int,
) -> None:
    num_seqs, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_sms = _num_sms(query.device)
    block_n, num_warps, num_stages = DECODE_TILE
    num_splits = _num_splits(num_seqs * num_kv_heads, max_seq_len, block_n, num_sms)
    split = num_splits > 1
    partials = num_seqs * num_q_heads * num_splits if split else 0
    partial_out = torch.empty(partials * head_size, dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(partials, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_size))
    num_queries_per_kv = num_q_heads // num_kv_heads
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        scale,
        softcap or 1.0,
        sliding_window or 0,
        head_size,
        num_q_heads,
        num_queries_per_kv,
        num_splits,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(num_queries_per_kv)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_size,
        SPLIT=split,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        block_s = triton.next_power_of_2(num_splits)
        merge_dims = min(block_d, max(DECODE_MERGE_MIN_DIMS, DECODE_MERGE_ELEMENTS // block_s))
        _decode_merge_kernel[(num_seqs, num_q_heads, triton.cdiv(head_size, merge_dims))](
            partial_out,
            partial_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_q_heads,
            num_splits,
            head_size,
            BLOCK_S=block_s,
            BLOCK_D=merge_dims,
        )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V.

    Same contract as ``reference.paged_attention``. A batch of decodes only
    (one new token per sequence) takes the flash-decoding path: the context
    is split across programs, each reading every K/V byte once for all the
    query heads that share it, and a second pass merges the splits. Other
    batches take the tiled prefill kernel. ``max_query_len`` and
    ``max_seq_len`` size the launch; they are computed, with a device sync,
    when not given.
    """
    check_attention_args(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        sliding_window,
        softcap,
    )
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    if not num_tokens or not len(seq_lens):
        return out
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max())
    if max_query_len == 1 and num_tokens == len(seq_lens):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        _decode(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            out,
            scale,
            sliding_window,
            softcap,
            max_seq_len,
        )
        return out
    # Small tiles for short chunks; large ones where prefill is compute-bound.
    if max_query_len <= 16:
        block_m, block_n, num_warps, num_stages = 16, 16, 4, 2
    else:
        block_m, block_n, num_warps, num_stages = (
            PREFILL_TILE if head_size <= 128 else PREFILL_TILE_LARGE_HEAD
        )
    block_d = max(16, triton.next_power_of_2(head_size))
    grid = (num_q_heads, triton.cdiv(max_query_len, block_m), len(seq_lens))
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        out,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        scale,
        softcap or 1.0,
        sliding_window or 0,
        head_size,
        num_q_heads // num_kv_heads,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_size,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
