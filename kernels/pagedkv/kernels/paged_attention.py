"""Triton paged attention over a packed varlen batch (prefill chunks and decodes).

One program computes ``BLOCK_M`` query tokens of one sequence for one query
head, streaming that sequence's K/V page by page through its block table with
an online softmax (flash-attention tiling; the program is
``prefill_kernel``'s, its tiling and the entry points are here). Causal masking is bottom-right
aligned: query token j of a sequence with ``seq_len`` tokens and ``q_len``
new ones is at position ``seq_len - q_len + j``. Oracle:
``reference.paged_attention``.

Batches of decodes take the flash-decoding path of ``decode_attention``
(whose ``rotary_decode_attention``, the one-launch decode, is exported here
too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton

from pagedkv.kernels import dequant_blocks, prefill_gluon
from pagedkv.kernels.checks import check_attention_args
from pagedkv.kernels.decode_attention import decode, rotary_decode_attention
from pagedkv.kernels.decode_split import DecodeSplit, TiledDecodes
from pagedkv.kernels.kv_quant import ScaleArgs, scale_args
from pagedkv.kernels.prefill_kernel import _paged_attention_kernel

__all__ = ["paged_attention", "prefill_tiling", "rotary_decode_attention", "tile_rows", "widening"]

# Prefill tiling: (query rows, keys per step, warps, pipeline stages, and
# optionally a cap on a thread's registers) at head sizes up to 128, over a
# bf16 or fp16 cache and over a quantized one (both 128 rows: a CUDA graph's
# tile schedule counts them), and a smaller one for larger heads (shared
# memory). The best of the sweeps at b = 8, 2,048 new tokens and 512 over
# 4,096 cached, with the read-ahead and the fused scale below on
# (kernels-prefill-tune-*-h200.json, and *-registers-h100.json for the
# cap): capped at 128 registers, two programs of the bf16 tile share a
# multiprocessor (80 KB of shared memory each, little spilled),
# and on an H100 it took 776 and 714 us against 834 and 746 for (128, 64,
# 8, 3) uncapped, the best tile of one program a multiprocessor; over fp8
# blocks the same cap was slower (1,107 against 960 us for (128, 128, 8,
# 3) at 2,048 new tokens).
PREFILL_TILE = (128, 32, 8, 3, 128)
PREFILL_QUANTIZED_TILE = (128, 128, 8, 3)
PREFILL_TILE_LARGE_HEAD = (32, 64, 4, 2)
# Keys a step, at least, of a decode entry's tiles beside prefill chunks at
# head sizes up to 128 (its program reads the whole context alone, one
# step's loads after another): the bf16 tile's 32 would quadruple its steps.
PREFILL_DECODE_KEYS = 128
SHORT_TILE = (16, 16, 4, 2)
# fp8 and int8 caches: V tiles widened before the dot's layout (attend's WIDEN_V).
PREFILL_FP8_WIDEN_V = True
# int8 caches: each K and V tile's rows scaled by their tokens' scales
# (attend's SCALE_TILES), not the scores' columns and the softmax weights:
# the prefill's 128 rows of scores would hold each column's scales in
# registers. For sm_90 the kernel then needs no stack at head size 64 or
# 128, where scaling the scores spilled into a stack of 328 and 776 bytes
# (kernels-sass-sm90{,-scaled-scores}.md, pagedkv.bench.kernels.sass).
PREFILL_INT8_SCALE_TILES = True
# int8 caches: tiles widened four values at a time in inline PTX (tiles.widen).
# On an H100 the int8 prefill took 1,179 us against 1,256 (b=8, 2,048 causal)
# and 1,141 against 1,206 (b=8, 512 over 4,096 cached) with it
# (kernels-int8-ptx-{True,False}-h100), so it is on.
PREFILL_INT8_PTX = True
# Unmasked tiles take the scale inside exp2's argument (attend's
# FUSED_SCALE): a fused multiply-add a score instead of a multiply and a
# subtraction. The block table is read a tile ahead (attend's PREFETCH):
# a tile's K and V loads then depend on no load of their own step, and
# with three stages the compiler issues them a step before their use (its
# wait lets two groups of copies stay in flight, where without the
# read-ahead it waited for every copy at the top of each step). On the
# H200 at (128, 128, 8, 3), both off against both on: bf16 907 and 809 us
# against 876 and 731, fp8 1,082 and 1,002 against 956 and 847 (at the
# former tile, (128, 128, 8, 2) with both off: bf16 860 and 791, fp8
# 1,060 and 999).
PREFILL_FUSED_SCALE = True
PREFILL_PREFETCH = True
# On an sm_90 GPU, the batches prefill_gluon covers (a float16 or bfloat16
# cache, head size 64 or 128, no window or soft-cap, 128-row tiles) take
# its kernel: by default the one with warps of their own
# (prefill_specialized), where two warpgroups compute and a third copies
# K/V pages. On an H100 it took 684 and 609 us against this kernel's 779
# and 722 (kernels-prefill-tune-bfloat16-specialized-h100.json, b = 8,
# 2,048 new tokens and 512 over 4,096 cached).
PREFILL_GLUON = True
# Over an fp8 or int8 cache, a batch the Gluon prefill would take over a
# float cache widens the blocks it reads into a buffer of the query's dtype
# first (``dequant_blocks``), then takes that kernel, when the buffer (its
# sequences times the longest one's pages, K and V) is at most
# PREFILL_DEQUANT_MAX_BYTES and holds at most PREFILL_DEQUANT_MAX_RATIO
# tokens a new token of the batch; else the Triton kernel reads the
# quantized cache. An executor allocates PREFILL_DEQUANT_MAX_BYTES for the
# buffer before it sizes its KV memory (model_runner.py), so a prefill's
# buffer never competes with the blocks. The ratio keeps the widening
# within what was measured to gain: on an H100 at b = 8 and head size 128
# the fp8 prefill took 634 us against 954 (2,048 new tokens, ratio 1) and
# 634 against 848 (512 over 4,096 cached, ratio 9;
# kernels-fp8-e4m3{,-unwidened}-h100). A chunk beside many decodes of long
# contexts would widen every decode's context for its new tokens' sake
# (the 8B shape's chunks beside up to 15 decodes of 8k tokens: ratios up
# to 16). Such steps take the Triton kernel, which the executor's warm-up
# builds with the widening off (warm_up.unwidened_steps). Served on an
# H100, the 8B fixed batch gives 683 output tokens/s over fp8 blocks
# against 646 over bf16 (serve-kv-*-8b-warmed-h100; the runs before, and
# what each fixed, in kernels.md, "Quantized caches").
PREFILL_DEQUANTIZE = True
PREFILL_DEQUANT_MAX_BYTES = 512 << 20
PREFILL_DEQUANT_MAX_RATIO = 10
# A batch whose leading entries are decodes, given with a ``DecodeSplit``
# (the executor's eager mixed steps), takes two launches: the
# flash-decoding kernel over the decodes, the prefill path over the rest
# alone (decode_split.py). Packed, each decode takes a prefill tile of its
# own with one live row and walks its whole context in that one program.
# Over an fp8 or int8 cache the rest's widening then holds only its own
# context, within the limits above where a chunk beside decodes of long
# contexts would exceed them. On an H100 the split takes 284.6 us against
# 794.8 packed for 512 new tokens over 7,168 cached beside 15 decodes of
# 7,936 over bf16 blocks, and 301.1 against 410.9 over fp8 blocks, whose
# packed batch the ratio limit leaves unwidened (kernels-mixed-*-h100).
PREFILL_SPLIT_DECODES = True


@contextmanager
def widening(enabled: bool) -> Iterator[None]:
    """``PREFILL_DEQUANTIZE`` set to ``enabled`` inside the block (the
    executor's warm-up builds the Triton prefill over quantized blocks, the
    path of the batches the widening leaves, with it off)."""
    global PREFILL_DEQUANTIZE
    before, PREFILL_DEQUANTIZE = PREFILL_DEQUANTIZE, enabled
    try:
        yield
    finally:
        PREFILL_DEQUANTIZE = before


def prefill_tiling(max_query_len: int, head_size: int, quantized: bool = False) -> tuple[int, ...]:
    """The prefill kernel's tiling for a batch whose longest query has
    ``max_query_len`` tokens: small tiles for short chunks, large ones where
    prefill is compute-bound (``quantized``: over an fp8 or int8 cache)."""
    if max_query_len <= 16:
        return SHORT_TILE
    if head_size > 128:
        return PREFILL_TILE_LARGE_HEAD
    return PREFILL_QUANTIZED_TILE if quantized else PREFILL_TILE


def tile_rows(max_query_len: int, head_size: int) -> int:
    """Query rows per tile of ``prefill_tiling`` (the same over any cache):
    the unit of a ``tiles`` schedule."""
    return prefill_tiling(max_query_len, head_size)[0]


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
    tiles: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split: DecodeSplit | TiledDecodes | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V.

    Same contract as ``reference.paged_attention``. ``tiles`` (int32 ``[2,
    n]``), when given, is the prefill kernel's schedule, read on the device:
    program ``j`` computes query tile ``tiles[1, j]`` (``tile_rows`` rows
    each, for ``max_query_len``) of sequence ``tiles[0, j]``, or nothing where
    that is -1. The launch is then fixed by ``n`` and ``max_query_len``
    whatever the batch (a CUDA graph replays it over other batches); the
    schedule must cover every query tile of every sequence once. A batch of decodes only
    (one new token per sequence) takes the flash-decoding path: the context
    is split across programs, each reading every K/V byte once for all the
    query heads that share it, and a second pass merges the splits. Other
    batches take the tiled prefill kernel. ``max_query_len`` and
    ``max_seq_len`` size the launch; they are computed, with a device sync,
    when not given. A quantized cache is read through ``k_scale`` and
    ``v_scale`` (``kv_quant``): an fp8 cache's per tensor or KV head, an
    int8 cache's per token and KV head. ``split`` (no ``tiles``) says that
    the batch's first entries are decodes and describes the rest: each
    part then takes its own launch (``PREFILL_SPLIT_DECODES``). With
    ``tiles``, a ``TiledDecodes`` ``split`` says that the schedule leaves
    out the leading decodes, which take the flash-decoding launch over its
    slots first (always: the schedule decided it).
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
        scale,
    )
    scales = scale_args(key_cache, k_scale, v_scale, seq_lens)
    num_tokens = query.shape[0]
    # A schedule's batch may carry padding tokens: zeros there, not whatever
    # the memory held (their rows flow through the rest of the layer).
    out = torch.empty_like(query) if tiles is None else torch.zeros_like(query)
    if not num_tokens or not len(seq_lens):
        return out
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max())
    if tiles is None and max_query_len == 1 and num_tokens == len(seq_lens):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
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
        )
        return out
    if tiles is not None:
        if tiles.ndim != 2 or tiles.shape[0] != 2 or tiles.dtype != torch.int32:
            raise ValueError("tiles: expected an int32 [2, num_tiles] tensor")
        tiles = tiles.contiguous()
    if isinstance(split, TiledDecodes):
        if tiles is None:
            raise ValueError("split: a TiledDecodes goes with tiles")
        _tiled_decodes(query, key_cache, value_cache, block_table, out, scale, sliding_window,
                       softcap, split, scales)  # fmt: skip
        split = None
    target = out
    if (
        tiles is None
        and split is not None
        and PREFILL_SPLIT_DECODES
        and 0 < split.num_decodes < len(seq_lens)
    ):
        decodes = split.num_decodes
        decode(
            query[:decodes],
            key_cache,
            value_cache,
            block_table[:decodes],
            seq_lens[:decodes],
            out[:decodes],
            scale,
            sliding_window,
            softcap,
            split.decode_max_seq_len,
            scales,
        )
        query, target = query[decodes:], out[decodes:]
        block_table, seq_lens, query_start_loc = (
            split.block_table,
            split.seq_lens,
            split.query_start_loc,
        )
        max_query_len, max_seq_len = split.max_query_len, split.max_seq_len
    _prefill(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        target,
        scale,
        sliding_window,
        softcap,
        max_query_len,
        max_seq_len,
        tiles,
        scales,
    )
    return out


def _tiled_decodes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    split: TiledDecodes,
    scales: ScaleArgs,
) -> None:
    """A tiled batch's leading decodes: the flash-decoding launch over its
    first ``split.num_slots`` tokens, before the tiles (which write the
    slots that are a prompt's rows again)."""
    slots = split.num_slots
    if not 0 < slots <= min(len(query), len(block_table)) or split.seq_lens.shape != (slots,):
        raise ValueError(
            f"split: {slots} slots with seq_lens of shape {tuple(split.seq_lens.shape)}"
            f" over {len(query)} tokens and {len(block_table)} entries"
        )
    decode(
        query[:slots],
        key_cache,
        value_cache,
        block_table[:slots],
        split.seq_lens,
        out[:slots],
        scale,
        sliding_window,
        softcap,
        split.max_seq_len,
        scales,
    )


def _prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    max_query_len: int,
    max_seq_len: int | None,
    tiles: torch.Tensor | None,
    scales: ScaleArgs,
) -> None:
    """``paged_attention``'s prefill path, writing ``out``: the Gluon
    kernel where it applies (over quantized blocks widened first, within
    the limits), else the Triton kernel."""
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if (
        PREFILL_GLUON
        and PREFILL_DEQUANTIZE
        and scales.quantized
        and tiles is None
        and tile_rows(max_query_len, head_size) == prefill_gluon.TILE_ROWS
        and prefill_gluon.supports_query(query, sliding_window, softcap)
    ):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        size = dequant_blocks.buffer_bytes(len(seq_lens), max_seq_len, key_cache, query.dtype)
        tokens = dequant_blocks.buffer_tokens(len(seq_lens), max_seq_len, key_cache.shape[1])
        if size <= PREFILL_DEQUANT_MAX_BYTES and tokens <= PREFILL_DEQUANT_MAX_RATIO * num_tokens:
            key_cache, value_cache, block_table = dequant_blocks.dequantize_blocks(
                key_cache, value_cache, block_table, seq_lens, max_seq_len, scales, query.dtype
            )
    if (
        PREFILL_GLUON
        and tile_rows(max_query_len, head_size) == prefill_gluon.TILE_ROWS
        and prefill_gluon.supported(query, key_cache, sliding_window, softcap)
    ):
        prefill_gluon.prefill(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale,
            max_query_len, tiles,
        )  # fmt: skip
        return
    # A fifth field, when a tile has one, caps a thread's registers (Triton's maxnreg).
    block_m, block_n, num_warps, num_stages, *registers = prefill_tiling(
        max_query_len, head_size, scales.quantized
    )
    limits = {"maxnreg": registers[0]} if registers else {}
    decode_keys = block_n
    if max_query_len > 16 and head_size <= 128:
        decode_keys = max(block_n, PREFILL_DECODE_KEYS)
    block_d = max(16, triton.next_power_of_2(head_size))
    if tiles is not None:
        grid: tuple[int, ...] = (num_q_heads, tiles.shape[1], 1)
    else:
        grid = (num_q_heads, triton.cdiv(max_query_len, block_m), len(seq_lens))
    _paged_attention_kernel[grid](
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
        scale,
        softcap or 1.0,
        sliding_window or 0,
        head_size,
        num_q_heads // num_kv_heads,
        tiles.shape[1] if tiles is not None else 0,
        scales.k_scale,
        scales.v_scale,
        scales.stride,
        scales.stride_b,
        scales.stride_s,
        TILED=tiles is not None,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DECODE_N=decode_keys,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_size,
        GROUP=max(16, triton.next_power_of_2(num_q_heads // num_kv_heads)),
        FP8=scales.fp8,
        WIDEN_V=scales.quantized and PREFILL_FP8_WIDEN_V,
        INT8=scales.int8_reads(PREFILL_INT8_PTX),
        SCALE_TILES=PREFILL_INT8_SCALE_TILES,
        FUSED_SCALE=PREFILL_FUSED_SCALE,
        PREFETCH=PREFILL_PREFETCH,
        num_warps=num_warps,
        num_stages=num_stages,
        **limits,
    )
