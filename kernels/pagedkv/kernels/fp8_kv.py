"""fp8 KV blocks: what storing K and V in eight bits means, in torch.

The contract the cache kernels will meet (and their torch oracle): a KV
cache of dtype ``float8_e4m3fn`` or ``float8_e5m2`` holds ``x / scale``
rounded to the format (saturated at its largest finite value, so an
outlier beyond the calibration clips instead of becoming inf or nan), and a
read gives ``stored * scale`` in the compute dtype. ``scale`` is float32,
one per layer and K or V (``[1]``, per tensor) or one per KV head too
(``[num_kv_heads]``), fixed once calibrated: the largest magnitude seen,
over the format's largest finite value (``calibrated_scale``), so the
calibration's own values never saturate.

``KV_CACHE_DTYPES`` names the formats as ``--kv-cache-dtype`` will.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
MIN_SCALE = 1e-12  # an all-zero calibration still gives a usable scale


def calibrated_scale(
    x: torch.Tensor,
    dtype: torch.dtype,
    per_head: bool,
    headroom: float = 1.0,
    rotation_pairs: bool = False,
) -> torch.Tensor:
    """float32 ``[num_kv_heads]`` (``per_head``) or ``[1]``: the scale that
    maps the largest magnitude of ``x`` (``[..., num_kv_heads, head_size]``)
    times ``headroom`` onto ``dtype``'s largest finite value. With
    ``rotation_pairs`` a magnitude is that of a pair of dims ``d`` and ``d +
    head_size / 2``: the largest any rotation of them (the rotary embedding)
    can reach, the same before and after it."""
    x = x.detach().float()
    if rotation_pairs:
        half = x.shape[-1] // 2
        amax = (x[..., :half].square() + x[..., half:].square()).sqrt()
    else:
        amax = x.abs()
    amax = amax.flatten(0, -3).amax(dim=(0, 2)) if per_head else amax.amax().reshape(1)
    return (amax * headroom / torch.finfo(dtype).max).clamp_min(MIN_SCALE)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (``[..., num_kv_heads, head_size]``) as ``dtype``: divided by
    ``scale`` (broadcast over the heads), saturated, rounded to nearest."""
    limit = torch.finfo(dtype).max
    scaled = x.float() / scale.view(-1, 1)
    return scaled.clamp(-limit, limit).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What a kernel reads back: ``q * scale`` in ``out_dtype``."""
    return (q.float() * scale.view(-1, 1)).to(out_dtype)


def round_trip(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` stored in ``dtype`` and read back, in ``x``'s dtype."""
    return dequantize(quantize(x, scale, dtype), scale, x.dtype)


def hadamard(size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``[size, size]``: the orthonormal Sylvester-Hadamard matrix of
    order ``size`` (a power of two), symmetric and its own inverse. Rotating
    a head's K and V by it before they are stored spreads a few large
    channels over all of them (docs/memory.md, "fp8 blocks")."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"hadamard: the size must be a power of two, not {size}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    result: torch.Tensor = (matrix / size**0.5).to(device)
    return result
