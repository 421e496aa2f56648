"""Flash-decoding over paged K/V: batches where every sequence has one new token.

One program per (sequence, KV head, split of the context) reads each K/V
byte once for all the query heads that share it (``decode_kernel``); a
second kernel merges the splits by their log-sum-exp (``decode_merge``).
Here: the launch constants, the splits and the launch, and
``rotary_decode_attention``, the decode that rotates and caches the new
tokens in the same launch. Launch constants come from
``python -m pagedkv.bench.kernels.tune`` on the H200. Oracle:
``reference.paged_attention``; the entry points are
``paged_attention.paged_attention``, which checks the arguments, and
``rotary_decode_attention`` (exported there too).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton

from pagedkv.kernels.checks import check_attention_args, check_rotary_args, check_rotate
from pagedkv.kernels.decode_kernel import _decode_split_kernel
from pagedkv.kernels.decode_merge import merge_splits
from pagedkv.kernels.kv_quant import ScaleArgs, scale_args
from pagedkv.kernels.tiles import WORDS_OPS, WORDS_PTX

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
# (tiles.widen, kv_quant.INT8_PTX) instead of through Triton's ops. On an
# H100 it took 312 us against 286 at 32 x 8k (head size 128) and 41.2
# against 40.8 at 64 x 768 (64; kernels-int8-ptx-{128,64}-h100), so it
# stays off.
DECODE_INT8_PTX = False
# DECODE_FP8_WORDS reads an fp8 cache's V tiles as 32-bit words and widens
# them four values a word (attend's WORDS; DECODE_INT8_WORDS an int8
# cache's): given byte tiles, the compiler unpacks every byte into a
# register of its own and packs pairs again for the conversion. Built for
# sm_90 the fp8 program drops from 141 registers to 108 at head size 128
# (102 to 80 at 64), so four programs fit a multiprocessor
# (DECODE_WORDS_PROGRAMS_PER_SM; six would leave a second, partial wave).
# On an H100 (``run-fp8-bench.sh words``, kernels-{fp8_e4m3,int8}-words-*)
# fp8 at head size 128 took 229 us against 245 at 32 x 8k, 231 against 237
# at 8 x 32k and 131 against 146 at 128 x 1k; at 64, 119 against 126 at
# 256 x 768 and 36 against 35 at 64 x 768. An int8 cache read as words
# reads its K tiles so too (attend's load_words); on the H100
# (``run-fp8-bench.sh int8-words``, kernels-int8-kv-words-*) that took
# 267 us against 289 at 32 x 8k, 260 against 283 at 8 x 32k, 39 against
# 41 at 64 x 768 and 137 against 139 at 256 x 768, but 174 against 160 at
# 128 x 1k (head size 128), so int8 stays on bytes.
DECODE_FP8_WORDS = True
DECODE_INT8_WORDS = False
DECODE_WORDS_PROGRAMS_PER_SM = 4
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


def words_mode(wanted: bool) -> int:
    """attend's ``WORDS``: off, else ``WORDS_PTX`` on a GPU and ``WORDS_OPS``
    under Triton's interpreter (which runs no PTX)."""
    if not wanted:
        return 0
    mode = WORDS_OPS if os.environ.get("TRITON_INTERPRET") == "1" else WORDS_PTX
    return int(mode.value)


def reads_words(int8: bool, head_size: int) -> bool:
    """Whether decode reads a quantized cache's V tiles as words: an int8
    (``int8``) or fp8 cache's switch, at a head size of a power of two."""
    wanted = DECODE_INT8_WORDS if int8 else DECODE_FP8_WORDS
    return bool(wanted and head_size == triton.next_power_of_2(head_size))


def launch_constants(quantized: bool, words: bool = False) -> tuple[tuple[int, int, int], int]:
    """The decode tile (keys per step, warps, stages) and the programs a
    multiprocessor holds at once, for a quantized cache (``DECODE_FP8_*``,
    fp8 or int8; ``DECODE_WORDS_PROGRAMS_PER_SM`` when it ``reads_words``)
    or a float one (``DECODE_*``)."""
    if quantized and words:
        return DECODE_FP8_TILE, DECODE_WORDS_PROGRAMS_PER_SM
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
    # Words need every value vector on a 4-byte boundary (a cache the
    # executor allocates has it; a view that lacks it reads bytes).
    aligned = value_cache.data_ptr() % 4 == 0 and all(
        stride % 4 == 0 for stride in value_cache.stride()[:3]
    )
    words = scales.quantized and aligned and reads_words(scales.int8, head_size)
    (block_n, num_warps, num_stages), per_sm = launch_constants(scales.quantized, words)
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
        WORDS=words_mode(words),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        merge_splits(partial_out, partial_lse, out, num_splits, block_d)


def rotary_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rotate: bool = False,
) -> torch.Tensor:
    """For a batch of one-token decodes, what ``rotary_and_cache`` and then
    ``paged_attention`` give, in one launch (the flash-decoding kernel rotates
    the query and writes the new keys and values itself); ``query`` is left
    as it is. ``rotate``: as ``rotary_and_cache``'s, the query and key in
    the Hadamard basis. Oracle: ``reference.rotary_decode_attention``."""
    check_rotary_args(query, key, value, cos_sin, positions, key_cache, value_cache, slot_mapping)
    check_rotate(rotate, query.shape[-1])
    check_attention_args(
        query, key_cache, value_cache, block_table, seq_lens, None, sliding_window, softcap, scale
    )
    scales = scale_args(key_cache, k_scale, v_scale, seq_lens)
    out = torch.empty_like(query)
    if not len(query):
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    rotary = Rotary(key, value, cos_sin, positions, slot_mapping, rotate)
    decode(
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
        scales,
        rotary,
    )
    return out
