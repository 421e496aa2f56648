"""One K or V tile of a paged cache, loaded for the attention kernels'
online-softmax step (``attend``): masked only where it may run out of
range, and a quantized cache's values widened to float16 (an int8 cache's
per-token scales loaded beside them)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_tile(
    ptrs,  # [BLOCK_N, BLOCK_D] pointers into a K or V cache
    row_valid,  # [BLOCK_N]
    dim_valid,  # [BLOCK_D]
    ROW_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    TRANSPOSED: tl.constexpr = False,
):
    """One K or V tile; masks only what may be out of range (rows past the
    keys when ``ROW_MASK``, padded dims unless ``EVEN_D``). ``TRANSPOSED``:
    ``ptrs`` is ``[BLOCK_D, BLOCK_N]``, the tile's transpose."""
    if TRANSPOSED:
        row_mask = row_valid[None, :]
        dim_mask = dim_valid[:, None]
    else:
        row_mask = row_valid[:, None]
        dim_mask = dim_valid[None, :]
    if ROW_MASK:
        tile = tl.load(ptrs, mask=row_mask & dim_mask, other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=dim_mask, other=0.0)
    return tile


# ``widen``'s packed int8 path: four bytes of one register, biased by
# 128, put under the exponent byte 0x64 two at a time by byte permutes
# (result bytes: value 0, 0x64, value 1, 0x64; then values 2 and 3), and
# 1152 (0x6480) taken off both halves of each register at once.
INT8_WIDEN_PTX = tl.constexpr("""{
.reg .b32 biased, bias;
xor.b32 biased, $2, 0x80808080;
prmt.b32 $0, biased, 0x64646464, 0x4140;
prmt.b32 $1, biased, 0x64646464, 0x4342;
mov.b32 bias, 0x64806480;
sub.f16x2 $0, $0, bias;
sub.f16x2 $1, $1, bias;
}""")


@triton.jit
def widen(tile, like, INT8: tl.constexpr):
    """``tile`` in ``like``'s dtype. An int8 tile (``INT8``) goes to
    float16 through its bits: ``x ^ 0x80`` is ``x + 128`` as a byte, which
    under the exponent bits ``0x64`` is the float16 ``1024 + x + 128``
    (the step there is 1), less 1152: exact, in logic ops and
    half-precision subtractions of two values at a time, where the
    compiler's int8-to-float16 conversion takes an instruction a value
    (``I2F``) and byte permutes besides. ``INT8 == kv_quant.INT8_PTX``
    does the same four values at a time in inline PTX (``INT8_WIDEN_PTX``):
    one XOR and two byte permutes for four values where the compiler,
    given the Triton ops, unpacks and repacks each byte."""
    if INT8 == 2:
        return tl.inline_asm_elementwise(
            INT8_WIDEN_PTX, "=r,=r,r", [tile], dtype=tl.float16, is_pure=True, pack=4
        )
    if INT8:
        biased = tile.to(tl.uint8, bitcast=True) ^ 0x80
        half = (biased.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        return half - 1152.0
    return tile.to(like.dtype)


# ``widen_words``' inline PTX: one 32-bit word of four cache bytes to four
# float16 values (outputs 0-3: bytes 0-3), two at a time: e4m3 through the
# hardware's pair conversion, e5m2 (float16's high byte) by byte permutes,
# int8 as INT8_WIDEN_PTX widens it.
_WORD_OUT = "mov.b32 {$0, $1}, a;\nmov.b32 {$2, $3}, b;\n}"
WORD_E4M3_PTX = tl.constexpr(
    "{\n.reg .b16 lo, hi;\n.reg .b32 a, b;\nmov.b32 {lo, hi}, $4;\n"
    "cvt.rn.f16x2.e4m3x2 a, lo;\ncvt.rn.f16x2.e4m3x2 b, hi;\n" + _WORD_OUT
)
WORD_E5M2_PTX = tl.constexpr(
    "{\n.reg .b32 a, b;\nprmt.b32 a, $4, 0, 0x1404;\nprmt.b32 b, $4, 0, 0x3424;\n" + _WORD_OUT
)
WORD_INT8_PTX = tl.constexpr(
    "{\n.reg .b32 biased, bias, a, b;\nxor.b32 biased, $4, 0x80808080;\n"
    "prmt.b32 a, biased, 0x64646464, 0x4140;\nprmt.b32 b, biased, 0x64646464, 0x4342;\n"
    "mov.b32 bias, 0x64806480;\nsub.f16x2 a, a, bias;\nsub.f16x2 b, b, bias;\n" + _WORD_OUT
)
# ``load_values``' WORDS constexpr: off; words widened in inline PTX; words
# widened by Triton's ops (the interpreter runs no PTX).
WORDS_PTX = tl.constexpr(1)
WORDS_OPS = tl.constexpr(2)


@triton.jit
def word_byte(packed, J: tl.constexpr, CACHE_DTYPE: tl.constexpr):
    """Byte ``J`` of each int32 word, as ``CACHE_DTYPE`` widened to float16."""
    byte = ((packed >> (8 * J)) & 0xFF).to(tl.uint8).to(CACHE_DTYPE, bitcast=True)
    if CACHE_DTYPE.is_int8():
        return widen(byte, byte, 1)
    return byte.to(tl.float16)


@triton.jit
def word_ptx(packed, ASM: tl.constexpr):
    """Each int32 word's four bytes as four float16 tensors, by ``ASM``."""
    return tl.inline_asm_elementwise(
        ASM,
        "=h,=h,=h,=h,r",
        [packed],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def widen_words(packed, CACHE_DTYPE: tl.constexpr, WORDS: tl.constexpr):
    """``[R, W]`` int32 words of four bytes of a quantized cache
    (``CACHE_DTYPE``: fp8 e4m3 or e5m2, or int8) as float16 ``[R, W, 2,
    2]``: byte ``j`` of word ``w`` at ``[.., w, j // 2, j % 2]``, exactly
    as ``widen`` widens it; in inline PTX (``WORDS_PTX``) or Triton's ops."""
    if WORDS == WORDS_PTX:
        if CACHE_DTYPE.is_int8():
            o0, o1, o2, o3 = word_ptx(packed, WORD_INT8_PTX)
        elif CACHE_DTYPE.is_fp8e5():
            o0, o1, o2, o3 = word_ptx(packed, WORD_E5M2_PTX)
        else:
            o0, o1, o2, o3 = word_ptx(packed, WORD_E4M3_PTX)
    else:
        o0 = word_byte(packed, 0, CACHE_DTYPE)
        o1 = word_byte(packed, 1, CACHE_DTYPE)
        o2 = word_byte(packed, 2, CACHE_DTYPE)
        o3 = word_byte(packed, 3, CACHE_DTYPE)
    # join's new axis is the last: [.., i, j] holds o(2 i + j).
    return tl.join(tl.join(o0, o2), tl.join(o1, o3))


@triton.jit
def load_words(
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size], one byte a value
    kv_offsets,  # [BLOCK_N] offsets of the tile's rows (multiples of 4)
    row_valid,  # [BLOCK_N]
    BLOCK_D: tl.constexpr,
    MASK: tl.constexpr,
    WORDS: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """One tile ``[BLOCK_N, BLOCK_D]`` of a quantized cache as float16, read
    as 32-bit words (``BLOCK_D == head_size``) and widened four values a
    word (``widen_words``); with ``TRANSPOSED`` its transpose, loaded so
    (as WIDEN_V loads a V tile: a vector's words are contiguous either way)."""
    BLOCK_N: tl.constexpr = kv_offsets.shape[0]
    words = tl.arange(0, BLOCK_D // 4)
    word_ptr = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if TRANSPOSED:
        ptrs = word_ptr + (kv_offsets // 4)[None, :] + words[:, None]
        rows = row_valid[None, :]
    else:
        ptrs = word_ptr + (kv_offsets // 4)[:, None] + words[None, :]
        rows = row_valid[:, None]
    packed = tl.load(ptrs, mask=rows, other=0) if MASK else tl.load(ptrs)
    tile = widen_words(packed, cache_ptr.dtype.element_ty, WORDS)  # [.., .., 2, 2]
    if TRANSPOSED:
        tile = tl.reshape(tl.permute(tile, (0, 2, 3, 1)), (BLOCK_D, BLOCK_N))
    else:
        tile = tl.reshape(tile, (BLOCK_N, BLOCK_D))
    return tile


@triton.jit
def load_values(
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    kv_ptrs,  # [BLOCK_N, BLOCK_D] offsets of the tile's values
    kv_offsets,  # [BLOCK_N] offsets of its rows
    row_valid,  # [BLOCK_N]
    dim_valid,  # [BLOCK_D]
    like,  # a tensor of the dtype the tile is widened to (the query)
    MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    WIDEN_V: tl.constexpr,
    INT8: tl.constexpr = False,
    WORDS: tl.constexpr = 0,
):
    """One V tile ``[BLOCK_N, BLOCK_D]`` in ``like``'s dtype (``widen``);
    with ``WIDEN_V`` loaded as its transpose and widened before it is
    transposed back (see ``attend``); with ``WORDS`` (a quantized cache)
    read as 32-bit words (``load_words``)."""
    if WORDS:
        tile = tl.trans(
            load_words(value_cache_ptr, kv_offsets, row_valid, kv_ptrs.shape[1], MASK, WORDS, True)
        )
    elif WIDEN_V:
        v_ptrs = value_cache_ptr + tl.trans(kv_ptrs)
        tile = load_tile(v_ptrs, row_valid, dim_valid, MASK, EVEN_D, True)
        tile = tl.trans(widen(tile, like, INT8))
    else:
        tile = load_tile(value_cache_ptr + kv_ptrs, row_valid, dim_valid, MASK, EVEN_D)
        tile = widen(tile, like, INT8)
    return tile


@triton.jit
def load_scales(scale_ptr, offsets, valid, MASK: tl.constexpr):
    """An int8 cache's scales (float16) of one tile's keys, as float32."""
    if MASK:
        scales = tl.load(scale_ptr + offsets, mask=valid, other=0.0)
    else:
        scales = tl.load(scale_ptr + offsets)
    return scales.to(tl.float32)
