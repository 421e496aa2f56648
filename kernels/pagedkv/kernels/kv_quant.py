"""Quantized KV caches in the Triton kernels: what every cache kernel shares.

A kernel that writes an fp8 cache stores ``quantize(x, scale)`` cast to the
cache's dtype; one that reads it converts the query and each tile to
float16 (exact for both fp8 formats, and on the GPU a cheaper conversion
than to bfloat16, whose conversions bound the decode kernel otherwise) and
folds the scales into the softmax scale (K) and the output (V). Scales are
float32, ``[1]`` or ``[num_kv_heads]`` (``pagedkv.kernels.fp8_kv``); a
kernel reads its KV head's at ``kv_head * scale_stride``. The semantics
(and the oracle) are ``fp8_kv``'s.

An int8 cache (``INT8``) has a float16 scale per token and KV head
(``pagedkv.kernels.int8_kv``), at ``block * scale_stride_b + offset *
scale_stride_s + kv_head * scale_stride``. A writer computes each vector's
(``int8_scale``) and stores it beside ``quantize_int8``'s values; a reader
widens each tile to float16 (exact: at most 127 in magnitude) and
multiplies each key's scores by its K scale and each value's softmax
weights by its V scale (``attend``): a multiply per score, not per value.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import FP8_DTYPES, check_kv_scales
from pagedkv.kernels.interpreter import fix_fp8_conversions

fix_fp8_conversions()


INT8_MAX = tl.constexpr(127.0)
# 1.5 * 2 ** 23: added to a float32 of magnitude below 2 ** 22 and taken
# away again, it leaves the value rounded to an integer, ties to even (the
# sum's last bit is worth 1), as torch.round rounds.
ROUNDER = tl.constexpr(12582912.0)
MIN_INT8_SCALE = tl.constexpr(6.103515625e-05)  # float16's smallest normal, int8_kv.MIN_SCALE


@triton.jit
def int8_scale(x, AXIS: tl.constexpr):
    """float16: each vector's int8 scale, the largest magnitude of ``x``
    (float32) along ``AXIS`` over 127, at least ``MIN_INT8_SCALE``
    (``int8_kv.token_scales``)."""
    amax = tl.max(tl.abs(x), AXIS)
    scale = tl.math.div_rn(amax, INT8_MAX).to(tl.float16).to(tl.float32)
    return tl.maximum(scale, MIN_INT8_SCALE).to(tl.float16)


@triton.jit
def quantize_int8(x, scale):
    """``x`` (float32) as an int8 cache stores it, before the cast: divided
    by its vector's ``scale`` (float32, broadcast), rounded to nearest with
    ties to even, clamped to +-127 (``int8_kv.quantize``)."""
    x = tl.math.div_rn(x, scale)
    x = (x + ROUNDER) - ROUNDER
    return tl.minimum(tl.maximum(x, -INT8_MAX), INT8_MAX)


@triton.jit
def quantize(x, scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """``x`` as an fp8 cache stores it, before the cast to the cache's
    dtype: divided by ``scale`` in float32 and saturated (``FP8``); else
    ``x`` itself."""
    if FP8:
        x = tl.math.div_rn(x.to(tl.float32), scale)  # rounded as torch divides
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x


# The readers' ``INT8`` constexpr: not int8; int8 widened by Triton's ops;
# int8 widened four values at a time in inline PTX (``tiles.widen``).
INT8_OPS = 1
INT8_PTX = 2


class ScaleArgs(NamedTuple):
    """A launch's scale arguments: the two pointers (placeholders, never
    read, for a float cache), the stride over KV heads, an int8 cache's
    strides over blocks and slots, and the constexprs ``FP8``, ``FP8_MAX``
    and ``INT8``."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    stride: int
    fp8: bool
    fp8_max: float
    stride_b: int = 0
    stride_s: int = 0
    int8: bool = False

    @property
    def quantized(self) -> bool:
        """The cache's tiles are read as float16 (fp8 or int8)."""
        return self.fp8 or self.int8

    def int8_reads(self, ptx: bool) -> int:
        """A reader's ``INT8``: 0 for a float or fp8 cache; for an int8
        one ``INT8_PTX`` when ``ptx`` asks for it and the kernel compiles
        for a GPU, else ``INT8_OPS`` (Triton's interpreter runs no PTX)."""
        if not self.int8:
            return 0
        if ptx and os.environ.get("TRITON_INTERPRET") != "1":
            return INT8_PTX
        return INT8_OPS


def scale_args(
    key_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    placeholder: torch.Tensor,
) -> ScaleArgs:
    """Checks the scales against the cache (``check_kv_scales``) and gives
    the launch's arguments."""
    stride = check_kv_scales(key_cache, k_scale, v_scale)
    if key_cache.dtype == torch.int8:
        assert k_scale is not None and v_scale is not None
        return ScaleArgs(
            k_scale, v_scale, stride, False, 0.0, k_scale.stride(0), k_scale.stride(1), True
        )
    if key_cache.dtype not in FP8_DTYPES:
        return ScaleArgs(placeholder, placeholder, 0, False, 0.0)
    assert k_scale is not None and v_scale is not None
    return ScaleArgs(k_scale, v_scale, stride, True, float(torch.finfo(key_cache.dtype).max))
