"""int8 KV blocks with a scale per token: what storing K and V this way
means, in torch.

The contract the cache kernels meet (and their torch oracle): an ``int8``
cache holds, for each token and KV head, its vector ``x`` (``[head_size]``)
as ``round(x / s)`` (to nearest, ties to even, clamped to +-127) and the
scale ``s`` beside it: ``max(|x|) / 127`` rounded to float16, at least
float16's smallest normal value (so an all-zero vector still divides).
A read gives ``stored * s`` in the compute dtype. The scale is computed
as each token is written, so there is nothing to calibrate, and each
vector is rounded on its own range: a token with large values costs no
other token its resolution.

Scales are float16 ``[num_blocks, block_size, num_kv_heads]`` per layer,
K and V each: in the executor they sit in the block's own memory, after
its values, so everything that moves a block moves its scales
(kv_memory.py). One block of head size ``D`` then takes ``D + 2`` bytes a
token and KV head where bf16 takes ``2 D``: 1.94x the blocks at head size
64, 1.97x at 128.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
SCALE_DTYPE = torch.float16
MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny  # 2 ** -14
SCALE_BYTES = 2  # a float16 scale per token and KV head


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """float16 ``x.shape[:-1]``: each vector's scale, ``max(|x|) / 127`` in
    float32 rounded to float16, at least ``MIN_SCALE``."""
    amax = x.float().abs().amax(-1)
    scales: torch.Tensor = (amax / INT8_MAX).to(SCALE_DTYPE).clamp_min(MIN_SCALE)
    return scales


def quantize(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 ``x`` (``[..., head_size]``): each vector divided by its scale
    (``scales``, ``x.shape[:-1]``) in float32, rounded to nearest (ties to
    even), clamped to +-127."""
    scaled = x.float() / scales.float()[..., None]
    return torch.round(scaled).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What a kernel reads back: ``q * scales`` (per vector) in ``out_dtype``."""
    return (q.float() * scales.float()[..., None]).to(out_dtype)


def block_storage(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's K (or V) of an int8 cache, zeroed: the storage, int8
    ``[num_blocks, block_bytes]``, each block its values then its scales;
    the values, ``[num_blocks, block_size, num_kv_heads, head_size]`` (a
    view whose blocks are ``block_bytes`` apart); and the scales, float16
    ``[num_blocks, block_size, num_kv_heads]`` (a view of the blocks'
    tails, each KV head's ``block_size`` scales together, so a program
    reading one KV head loads a block's scales in one piece). Copies of the
    storage's blocks move both."""
    values_bytes = block_size * num_kv_heads * head_size
    block_bytes = values_bytes + block_size * num_kv_heads * SCALE_BYTES
    storage = torch.zeros(num_blocks, block_bytes, dtype=torch.int8, device=device)
    values = storage.as_strided(
        (num_blocks, block_size, num_kv_heads, head_size),
        (block_bytes, num_kv_heads * head_size, head_size, 1),
    )
    tails = storage[:, values_bytes:].view(SCALE_DTYPE)
    scales = tails.view(num_blocks, num_kv_heads, block_size).transpose(1, 2)
    return storage, values, scales


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` stored as an int8 cache stores it and read back, in ``x``'s dtype."""
    scales = token_scales(x)
    return dequantize(quantize(x, scales), scales, x.dtype)


KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8}  # as --kv-cache-dtype names it
