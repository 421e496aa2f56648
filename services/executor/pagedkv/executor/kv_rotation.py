"""K and V stored in the Hadamard basis (``--kv-cache-rotation``).

fp8 rounds each value relative to its own magnitude, so most of a score's
rounding error sits in the few large channels that a query shares with its
keys. Stored times the orthonormal Hadamard matrix ``H`` of the head size
(``pagedkv.kernels.fp8_kv.hadamard``: symmetric, its own inverse), every
channel is spread over all of them; on the accuracy bench's trained llamas
e4m3 blocks kept 0.1-0.3 point more of the top-1 tokens (docs/memory.md,
"fp8 blocks"). int8 blocks round each vector on its largest magnitude,
which a few large channels set: rotated, the attention output's error on
activations with outlier channels fell from 0.066 to 0.014 (docs/memory.md,
"int8 blocks"). Nothing is rotated back on reading:

- keys: the cache write rotates the query and the key after the rotary
  embedding (``rotary_and_cache(rotate=True)`` in the fused stack; a
  product here for transformers' modules), and ``qH . kH = q . k``;
- values: ``H`` is folded into each layer's value projection at load
  (``v' = v H``) and into its output projection (``o_proj`` takes ``o' H =
  o``), so attention over rotated values needs no change.

A rotated value's magnitude is at most its vector's norm, which neither
rotation changes, so an fp8 memory's scales come from each KV head's
largest norm in the calibration forward (``rotated_scales``), whatever
the calibration tokens' channels look like.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.kernels import int8_kv
from pagedkv.kernels.checks import MIN_ROTATED_HEAD_SIZE
from pagedkv.kernels.fp8_kv import KV_CACHE_DTYPES, calibrated_scale, hadamard

ROTATIONS = ("auto", "none", "hadamard")


def _attention_modules(model: torch.nn.Module) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]


def supports_rotation(model: torch.nn.Module, head_size: int) -> str | None:
    """Why ``model`` cannot store its K and V rotated, or None when it can: a
    head size that is a power of two (at least 32) and attention layers with
    a value projection of their own."""
    if head_size < MIN_ROTATED_HEAD_SIZE or head_size & (head_size - 1):
        return f"its head size {head_size} is not a power of two of at least 32"
    modules = _attention_modules(model)
    if not modules or not all(
        isinstance(getattr(m, "v_proj", None), torch.nn.Linear) for m in modules
    ):
        return "its attention layers have no value projection of their own"
    return None


def resolve_rotation(
    name: str, kv_cache_dtype: str, model: torch.nn.Module, head_size: int, stored_scales: bool
) -> bool:
    """Whether to rotate: ``hadamard`` always (ValueError naming
    ``kv_cache_rotation`` when the model cannot), ``none`` never, ``auto``
    for an fp8 memory whose checkpoint stores no scales (those were taken on
    values as they are), and for an int8 one, when the model can."""
    if name not in ROTATIONS:
        raise ValueError(f"kv_cache_rotation: {name!r} is not one of {', '.join(ROTATIONS)}")
    if name == "none":
        return False
    reason = supports_rotation(model, head_size)
    if name == "hadamard":
        if reason is not None:
            raise ValueError(f"kv_cache_rotation: hadamard needs another model ({reason})")
        return True
    if reason is not None:
        return False
    fp8 = kv_cache_dtype in KV_CACHE_DTYPES and not stored_scales
    return fp8 or kv_cache_dtype in int8_kv.KV_CACHE_DTYPES


@torch.no_grad()
def fold_value_rotation(model: torch.nn.Module, head_size: int) -> None:
    """Folds ``H`` into every attention layer's value projection (each KV
    head's rows: ``W' = H W``, its bias ``b H``) and output projection (each
    query head's columns: ``W' = W H``), in float32, rounded once to the
    weights' dtype."""
    for module in _attention_modules(model):
        for linear, rows in ((module.v_proj, True), (module.o_proj, False)):
            weight = linear.weight
            rotation = hadamard(head_size, weight.device)
            w = weight.float()
            if rows:  # [Hkv * D, hidden]
                w = (rotation @ w.view(-1, head_size, w.shape[1])).reshape(w.shape)
                if linear.bias is not None:
                    bias = linear.bias.float().view(-1, head_size) @ rotation
                    linear.bias.copy_(bias.reshape(-1).to(linear.bias.dtype))
            else:  # [hidden, Hq * D]
                w = (w.view(w.shape[0], -1, head_size) @ rotation).reshape(w.shape)
            weight.copy_(w.to(weight.dtype))


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x`` (``[..., head_size]``) times ``rotation``, in float32, in ``x``'s dtype."""
    return (x.float() @ rotation).to(x.dtype)


def rotated_scales(
    key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype, headroom: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[num_kv_heads]`` K and V scales for rotated values: each KV
    head's largest vector norm (``[..., num_kv_heads, head_size]``, rotated
    or not) times ``headroom`` on the format's largest value."""
    norms = [x.detach().float().norm(dim=-1, keepdim=True) for x in (key, value)]
    k_scale, v_scale = (calibrated_scale(n, dtype, True, headroom) for n in norms)
    return k_scale, v_scale
