"""Flash-decoding over paged K/V: batches where every sequence has one new token.

One program per (sequence, KV head, split of the context) reads each K/V
byte once for all the query heads that share it; a second kernel merges the
splits by their log-sum-exp (``decode_merge``). Launch constants come from
``python -m pagedkv.bench.kernels.tune`` on the H200. Oracle:
``reference.paged_attention``; the entry point is
``paged_attention.paged_attention``, which checks the arguments.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedkv.kernels.attend import MASKED, attend_span
from pagedkv.kernels.decode_merge import merge_splits
from pagedkv.kernels.kv_quant import ScaleArgs, int8_scale, quantize, quantize_int8
from pagedkv.kernels.rotary import hadamard


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
    key_ptr,  # ROTARY: [num_seqs, num_kv_heads, head_size], the new tokens' keys
    value_ptr,  # ROTARY: [num_seqs, num_kv_heads, head_size], their values
    cos_sin_ptr,  # ROTARY: [max_position, head_size], as rotary_and_cache reads it
    positions_ptr,  # ROTARY: [num_seqs]
    slot_mapping_ptr,  # ROTARY: [num_seqs], the new tokens' slots (negative: none)
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    k_scale_ptr,  # FP8: [1] or [num_kv_heads], float32; INT8: per token (kv_quant)
    v_scale_ptr,
    scale_stride,
    scale_stride_b,
    scale_stride_s,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    SPLIT: tl.constexpr,
    ROTARY: tl.constexpr,
    ROTATE: tl.constexpr,  # ROTARY: then the Hadamard basis (BLOCK_D == head_size == 2 ** LEVELS)
    LEVELS: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    WIDEN_V: tl.constexpr,
    PREFETCH: tl.constexpr,
    INT8: tl.constexpr,
    SCALE_TILES: tl.constexpr,  # attend's: INT8 tiles scaled, not their scores
):
    """Flash-decoding: one (sequence, KV head, split of the context) per
    program; the query heads sharing the KV head are the rows, so each K/V
    byte is read once for all of them. With ``SPLIT`` each program stores its
    partial output and log-sum-exp for ``decode_merge``; without,
    there is one split and the program stores the output. With ``ROTARY``
    the query is rotated here (left as it is in memory), and the program
    whose split holds the new token rotates its key and writes it and its
    value at its slot before it reads the cache, as ``rotary_and_cache``
    would have (the same float32 rotation, rounded once to the query's
    dtype; with ``ROTATE`` times the Hadamard matrix before that rounding,
    as ``rotary_and_cache(rotate=True)``). An fp8 or int8 cache is written
    quantized and read through its scales."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr + kv_head * scale_stride)
        v_scale = tl.load(v_scale_ptr + kv_head * scale_stride)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    q_pos = seq_len - 1

    groups = tl.arange(0, BLOCK_G)
    group_valid = groups < num_queries_per_kv
    heads = kv_head * num_queries_per_kv + groups
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size
    q_ptrs = query_ptr + seq * query_stride_t + heads[:, None] * query_stride_h
    q_mask = group_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptrs + dims[None, :], mask=q_mask, other=0.0)

    # Each sequence's own context is split (in whole steps), so a launch sized
    # for a longer bound (a CUDA graph's) still spreads a short one out.
    split_size = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)
    if ROTARY:
        # Dim d pairs with d + half (d < half) or d - half: rotate_half.
        half = head_size // 2
        pair = tl.where(dims < half, dims + half, dims - half)
        angle = cos_sin_ptr + tl.load(positions_ptr + seq).to(tl.int64) * head_size + dims % half
        cos = tl.load(angle, mask=dim_valid, other=0.0).to(tl.float32)
        sin = tl.load(angle + half, mask=dim_valid, other=0.0).to(tl.float32)
        sin = tl.where(dims < half, -sin, sin)
        q_pair = tl.load(q_ptrs + pair[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q_rotated = q.to(tl.float32) * cos[None, :] + q_pair * sin[None, :]
        if ROTATE:
            q_rotated = hadamard(q_rotated, BLOCK_G, BLOCK_D, LEVELS)
        q = q_rotated.to(q.dtype)
        q_rows = out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + dims[None, :]
        if ROTATE:
            # Staged in the output's rows (this program's heads; every split
            # of them stores the same values) and read back below: the
            # butterflies' layout would otherwise hold the query in registers
            # through the loop, where a loaded one is kept in shared memory.
            tl.store(q_rows, q, mask=q_mask)
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        writes = (start <= q_pos) & (q_pos < end) & (slot >= 0)
        slot = tl.where(slot >= 0, slot, 0)
        kv_mask = dim_valid & writes
        k_ptrs = key_ptr + seq * key_stride_t + kv_head * key_stride_h
        k = tl.load(k_ptrs + dims, mask=kv_mask, other=0.0).to(tl.float32)
        k_pair = tl.load(k_ptrs + pair, mask=kv_mask, other=0.0).to(tl.float32)
        v_ptrs = value_ptr + seq * value_stride_t + kv_head * value_stride_h
        v = tl.load(v_ptrs + dims, mask=kv_mask, other=0.0)
        dst = (
            (slot // BLOCK_SIZE) * cache_stride_b
            + (slot % BLOCK_SIZE) * cache_stride_s
            + kv_head * cache_stride_h
            + dims
        )
        cache_dtype = key_cache_ptr.dtype.element_ty
        key_out = k * cos + k_pair * sin
        if ROTATE:
            key_out = tl.reshape(hadamard(key_out[None, :], 1, BLOCK_D, LEVELS), [BLOCK_D])
        key_out = key_out.to(query_ptr.dtype.element_ty)
        if INT8:
            key_out = key_out.to(tl.float32)
            v = v.to(tl.float32)
            k_token_scale = int8_scale(key_out, 0)
            v_token_scale = int8_scale(v, 0)
            key_out = quantize_int8(key_out, k_token_scale.to(tl.float32))
            v = quantize_int8(v, v_token_scale.to(tl.float32))
            scale_dst = (
                (slot // BLOCK_SIZE) * scale_stride_b
                + (slot % BLOCK_SIZE) * scale_stride_s
                + kv_head * scale_stride
            )
            tl.store(k_scale_ptr + scale_dst, k_token_scale, mask=writes)
            tl.store(v_scale_ptr + scale_dst, v_token_scale, mask=writes)
        key_out = quantize(key_out, k_scale, FP8, FP8_MAX).to(cache_dtype)
        v = quantize(v, v_scale, FP8, FP8_MAX).to(cache_dtype)
        tl.store(key_cache_ptr + dst, key_out, mask=kv_mask)
        tl.store(value_cache_ptr + dst, v, mask=kv_mask)
        tl.debug_barrier()  # the new key and value are read below, by other threads
        if ROTATE:
            q = tl.load(q_rows, mask=q_mask, other=0.0)
    if FP8 or INT8:
        q = q.to(tl.float16)  # the tiles' dtype too (kv_quant)
    if USE_WINDOW:
        first = tl.maximum(q_pos - sliding_window + 1, 0)
        start = tl.maximum(start, (first // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_G], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    q_pos_rows = tl.zeros([BLOCK_G], dtype=tl.int64) + q_pos
    # Whole tiles need no mask (every key is at or before the query); the
    # last, partial one does, and so does every tile under a window.
    full_end = start
    if not USE_WINDOW:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = attend_span(
        q,
        q_pos_rows,
        m_i,
        l_i,
        acc,
        start,
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
        scale * k_scale,
        softcap,
        sliding_window,
        dims,
        dim_valid,
        k_scale_ptr + kv_head * scale_stride,
        v_scale_ptr + kv_head * scale_stride,
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
    )

    if SPLIT:
        # An empty split (past the sequence, or before its window) has l_i == 0.
        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if FP8:
            out = out * v_scale
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), MASKED)  # base 2
        row = (seq * num_q_heads + heads) * num_splits + split
        tl.store(
            partial_out_ptr + row[:, None] * head_size + dims[None, :],
            out,
            mask=group_valid[:, None] & dim_valid[None, :],
        )
        tl.store(partial_lse_ptr + row, lse, mask=group_valid)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if FP8:
            out = out * v_scale
        tl.store(
            out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=group_valid[:, None] & dim_valid[None, :],
        )


# Decode tuning, from ``python -m pagedkv.bench.kernels.tune`` on the H200 (results
# in tests/benchmarks/results/kernels-tune-h200.json). DECODE_TILE: keys per
# step, warps and pipeline stages. DECODE_PROGRAMS_PER_SM: how many of those
# programs a multiprocessor holds at once (at head size 128 registers allow
# 4); the context is split into as many pieces as fill that in one wave, as
# a second, partial wave would leave most of the GPU idle. A split takes at
# least DECODE_MIN_STEPS_PER_SPLIT steps.
DECODE_TILE = (64, 4, 2)
DECODE_PROGRAMS_PER_SM = 4
# The same for fp8 caches, from ``tune --kv-cache-dtype fp8_e4m3`` on the
# H200 (kernels-tune-fp8-{128,64}-h200.json). Widening V before the dot's
# layout (``attend``'s WIDEN_V) reads it from shared memory through ldmatrix,
# not a byte at a time (2-8% faster). The fp8 program holds about 168
# registers at head size 128 (3 programs a multiprocessor, against 5 for
# bf16), so splits aim for two full waves of 3 rather than one and a third
# of 4 (32 x 8k: 233 us against 300).
DECODE_FP8_TILE = (64, 4, 2)
DECODE_FP8_PROGRAMS_PER_SM = 6
DECODE_FP8_WIDEN_V = True
# Each tile's block table entries read one step ahead, and its V with its K
# (``attend``'s PREFETCH). On an H100 (``run-fp8-bench.sh prefetch``) the
# rotated one-launch decode over fp8 blocks took 7.4-7.7% less at 64 and 256
# x 768 (executor-kv-*-prefetch-*-h100); over bf16 blocks it changed
# nothing (689 us against 691), so float caches keep the plain loop.
DECODE_PREFETCH = False
DECODE_FP8_PREFETCH = True
# int8 caches (a scale per token) take the fp8 constants above: their tiles
# are bytes widened to float16 as fp8's are. They are not tuned for int8.
# DECODE_INT8_SCALE_TILES scales each K and V tile's rows by their tokens'
# scales (attend's SCALE_TILES) instead of the scores and softmax weights.
# Built for sm_90 (pagedkv.bench.kernels.sass, kernels-sass-sm90*.md) it
# made the decode kernel 9% shorter at head size 64 (1,808 instructions
# against 1,992; 104 registers against 96) and 2% at 128 (with 192
# registers against 146: two programs a multiprocessor instead of three).
# Timed on an H100 it was slower at head size 64 all the same: 42.0 us
# against 41.4 at 64 x 768 and 147.2 against 141.0 at 256 x 768
# (``tune --switch``, kernels-int8-scale-tiles-64-h100.json), and the
# executor bench's decode kernel 700.5 us against 652.5 a step
# (executor-kv-int8-scale-tiles-{True,False}-h100). So it stays off.
DECODE_INT8_SCALE_TILES = False
# DECODE_INT8_PTX widens int8 tiles four values at a time in inline PTX
# (attend.widen, kv_quant.INT8_PTX) instead of through Triton's ops. On an
# H100 it took 312 us against 286 at 32 x 8k (head size 128) and 41.2
# against 40.8 at 64 x 768 (64; kernels-int8-ptx-{128,64}-h100), so it
# stays off.
DECODE_INT8_PTX = False
DECODE_MAX_SPLITS = 256
DECODE_MIN_STEPS_PER_SPLIT = 1


class Rotary(NamedTuple):
    """What ``rotary_and_cache`` takes besides the query and the caches."""

    key: torch.Tensor  # [num_seqs, num_kv_heads, head_size]
    value: torch.Tensor  # [num_seqs, num_kv_heads, head_size]
    cos_sin: torch.Tensor  # [max_position, head_size]
    positions: torch.Tensor  # [num_seqs]
    slot_mapping: torch.Tensor  # [num_seqs]
    rotate: bool = False  # rotary_and_cache's: the Hadamard basis

    def arguments(self) -> tuple[object, ...]:
        return (
            self.key,
            self.value,
            self.cos_sin,
            self.positions,
            self.slot_mapping,
            self.key.stride(0),
            self.key.stride(1),
            self.value.stride(0),
            self.value.stride(1),
        )


def _no_rotary(like: torch.Tensor) -> Rotary:
    """Placeholders for a launch without ``ROTARY`` (never read)."""
    return Rotary(like, like, like, like, like)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (8 for the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def launch_constants(quantized: bool) -> tuple[tuple[int, int, int], int]:
    """The decode tile (keys per step, warps, stages) and the programs a
    multiprocessor holds at once, for a quantized cache (``DECODE_FP8_*``,
    fp8 or int8) or a float one (``DECODE_*``)."""
    if quantized:
        return DECODE_FP8_TILE, DECODE_FP8_PROGRAMS_PER_SM
    return DECODE_TILE, DECODE_PROGRAMS_PER_SM


def split_count(
    num_pairs: int, max_seq_len: int, block_n: int, num_sms: int, programs_per_sm: int = 0
) -> int:
    """Splits of each (sequence, KV head)'s context: as many as the GPU holds
    programs in one wave (``programs_per_sm``, else DECODE_PROGRAMS_PER_SM),
    and no more than the longest context has steps."""
    wanted = (programs_per_sm or DECODE_PROGRAMS_PER_SM) * num_sms // num_pairs
    longest = triton.cdiv(max_seq_len, DECODE_MIN_STEPS_PER_SPLIT * block_n)
    return int(max(1, min(wanted, longest, DECODE_MAX_SPLITS)))


def decode(
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
    scales: ScaleArgs,
    rotary: Rotary | None = None,
) -> None:
    """Writes ``out`` ``[num_seqs, num_q_heads, head_size]`` for a batch of
    one-token decodes (``query`` holds one token per sequence), arguments
    checked by the caller; ``max_seq_len`` is an upper bound of ``seq_lens``
    and sizes the launch. With ``rotary``, the query is rotated first (not
    in place) and the new tokens' keys, rotated, and values are written to
    the cache first, as ``rotary_and_cache`` does."""
    num_seqs, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_sms = sm_count(query.device)
    (block_n, num_warps, num_stages), per_sm = launch_constants(scales.quantized)
    num_splits = split_count(num_seqs * num_kv_heads, max_seq_len, block_n, num_sms, per_sm)
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
        *(rotary or _no_rotary(query)).arguments(),
        scales.k_scale,
        scales.v_scale,
        scales.stride,
        scales.stride_b,
        scales.stride_s,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(num_queries_per_kv)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_size,
        SPLIT=split,
        ROTARY=rotary is not None,
        ROTATE=rotary is not None and rotary.rotate,
        LEVELS=block_d.bit_length() - 1,
        FP8=scales.fp8,
        FP8_MAX=scales.fp8_max,
        WIDEN_V=scales.quantized and DECODE_FP8_WIDEN_V,
        PREFETCH=DECODE_FP8_PREFETCH if scales.quantized else DECODE_PREFETCH,
        INT8=scales.int8_reads(DECODE_INT8_PTX),
        SCALE_TILES=DECODE_INT8_SCALE_TILES,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        merge_splits(partial_out, partial_lse, out, num_splits, block_d)
