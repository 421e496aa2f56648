"""fp8 KV caches in the Triton kernels: what every cache kernel shares.

A kernel that writes an fp8 cache stores ``quantize(x, scale)`` cast to the
cache's dtype; one that reads it converts the query and each tile to
float16 (exact for both fp8 formats, and on the GPU a cheaper conversion
than to bfloat16, whose conversions bound the decode kernel otherwise) and
folds the scales into the softmax scale (K) and the output (V). Scales are
float32, ``[1]`` or ``[num_kv_heads]`` (``pagedkv.kernels.fp8_kv``); a
kernel reads its KV head's at ``kv_head * scale_stride``. The semantics
(and the oracle) are ``fp8_kv``'s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedkv.kernels.checks import FP8_DTYPES, check_kv_scales
from pagedkv.kernels.interpreter import fix_fp8_conversions

fix_fp8_conversions()


@triton.jit
def quantize(x, scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """``x`` as an fp8 cache stores it, before the cast to the cache's
    dtype: divided by ``scale`` in float32 and saturated (``FP8``); else
    ``x`` itself."""
    if FP8:
        x = tl.math.div_rn(x.to(tl.float32), scale)  # rounded as torch divides
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x


class ScaleArgs(NamedTuple):
    """A launch's scale arguments: the two pointers (placeholders, never
    read, for a float cache), the stride over KV heads, and the constexprs
    ``FP8`` and ``FP8_MAX``."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    stride: int
    fp8: bool
    fp8_max: float


def scale_args(
    key_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    placeholder: torch.Tensor,
) -> ScaleArgs:
    """Checks the scales against the cache (``check_kv_scales``) and gives
    the launch's arguments."""
    stride = check_kv_scales(key_cache, k_scale, v_scale)
    if key_cache.dtype not in FP8_DTYPES:
        return ScaleArgs(placeholder, placeholder, 0, False, 0.0)
    assert k_scale is not None and v_scale is not None
    return ScaleArgs(k_scale, v_scale, stride, True, float(torch.finfo(key_cache.dtype).max))
