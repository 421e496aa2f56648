"""The executor's KV memory: K and V tensors per layer, in the kernels' layout
``[num_blocks, block_size, num_kv_heads, head_size]``.

Block ids are one space for every group: block ``b`` of a group's table
addresses index ``b`` of that group's layers' tensors. So one block id
accounts for ``page_size_bytes`` in every layer of every group
(``bytes_per_block``). Block 0 is the null block: never written by a real
token (the scheduler never hands it out for one).

An fp8 memory (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``) also holds each
layer's K and V scales, float32 ``[num_kv_heads]`` on the device
(``pagedkv.kernels.fp8_kv``): ones until the checkpoint's (``set_scales``)
or the executor's first forward (``calibrate``) sets them, once, before it
serves (kv_calibration.py). The tensors stay where they are, so CUDA graphs
captured over them read the values set.

An int8 memory (``--kv-cache-dtype int8``) keeps a float16 scale per token
and KV head, computed as each token is written (``pagedkv.kernels.int8_kv``;
nothing to calibrate). Each layer's K (and V) is one allocation, its
``storage``: block after block, each its values then its scales. The
caches the kernels read are views of its values, the scales views of its
tails, so a block copy or a move to the host tier (which move the storage)
carries a block's scales with its values.
"""

from __future__ import annotations

import torch

from pagedkv.executor.kv_rotation import rotated_scales
from pagedkv.executor.model_spec import KVCacheGroup
from pagedkv.kernels.backend import KernelBackend
from pagedkv.kernels.checks import FP8_DTYPES
from pagedkv.kernels.fp8_kv import calibrated_scale
from pagedkv.kernels.int8_kv import block_storage

# The calibration's largest magnitude lands at 1/HEADROOM of the format's
# largest value: later activations up to twice as large still fit, and the
# rest saturate instead of overflowing.
CALIBRATION_HEADROOM = 2.0


def bytes_per_block(groups: tuple[KVCacheGroup, ...]) -> int:
    """Device bytes one block id accounts for, over all groups' layers."""
    return sum(group.spec.page_size_bytes * len(group.layer_indices) for group in groups)


def calibration_scales(
    key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[num_kv_heads]`` K and V scales for the fp8 ``dtype`` from K
    and V ``[..., num_kv_heads, head_size]`` (``fp8_kv.calibrated_scale`` per
    KV head, with ``CALIBRATION_HEADROOM``). The key's magnitude is taken
    over the rotation's pairs, the same before and after the rotary
    embedding, so the fused stack (which rotates inside the cache write) and
    transformers' modules calibrate alike."""
    k_scale = calibrated_scale(key, dtype, True, CALIBRATION_HEADROOM, rotation_pairs=True)
    v_scale = calibrated_scale(value, dtype, True, CALIBRATION_HEADROOM)
    return k_scale, v_scale


class KVMemory:
    """``num_blocks`` blocks for every layer of ``groups``, K and V, zeroed."""

    def __init__(
        self,
        groups: tuple[KVCacheGroup, ...],
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        rotation: torch.Tensor | None = None,
    ) -> None:
        """``rotation``: the Hadamard matrix when K and V are stored in its
        basis (kv_rotation.py), which the scales' calibration and the
        forwards' metadata follow."""
        num_layers = sum(len(group.layer_indices) for group in groups)
        self.groups = groups
        self.num_blocks = num_blocks
        self.layer_groups = [0] * num_layers
        # Per layer, K then V: (storage, cache, per-token scales or None).
        parts: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = [
            [] for _ in range(num_layers)
        ]
        for g, group in enumerate(groups):
            spec = group.spec
            shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            for layer in group.layer_indices:
                self.layer_groups[layer] = g
                for _ in range(2):
                    if dtype == torch.int8:
                        parts[layer].append(block_storage(*shape, device=device))
                    else:
                        cache = torch.zeros(shape, dtype=dtype, device=device)
                        parts[layer].append((cache, cache, None))
        assert all(parts), "every layer belongs to a group"
        self.key_caches: tuple[torch.Tensor, ...] = tuple(p[0][1] for p in parts)
        self.value_caches: tuple[torch.Tensor, ...] = tuple(p[1][1] for p in parts)
        # What block copies move: the caches themselves, or an int8 memory's storage.
        self.key_storage: tuple[torch.Tensor, ...] = tuple(p[0][0] for p in parts)
        self.value_storage: tuple[torch.Tensor, ...] = tuple(p[1][0] for p in parts)
        self.dtype = dtype
        self.rotation = rotation
        self.k_scales: tuple[torch.Tensor, ...] | None = None
        self.v_scales: tuple[torch.Tensor, ...] | None = None
        self.calibrated = dtype not in FP8_DTYPES
        if dtype == torch.int8:
            self.k_scales = tuple(p[0][2] for p in parts if p[0][2] is not None)
            self.v_scales = tuple(p[1][2] for p in parts if p[1][2] is not None)
        if not self.calibrated:
            self.k_scales, self.v_scales = (
                tuple(
                    torch.ones(cache.shape[2], dtype=torch.float32, device=device)
                    for cache in self.key_caches
                )
                for _ in range(2)
            )

    def calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Sets ``layer``'s scales from its K and V of a forward
        (``calibration_scales``)."""
        assert self.k_scales is not None and self.v_scales is not None
        if self.rotation is not None:  # bounded by each vector's norm (kv_rotation.py)
            k_scale, v_scale = rotated_scales(key, value, self.dtype, CALIBRATION_HEADROOM)
        else:
            k_scale, v_scale = calibration_scales(key, value, self.dtype)
        self.k_scales[layer].copy_(k_scale)
        self.v_scales[layer].copy_(v_scale)

    def set_scales(self, scales: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every layer's K and V scales as given (``[1]`` or ``[num_kv_heads]``
        each), fixed from now on."""
        assert self.k_scales is not None and self.v_scales is not None
        for layer, (k_scale, v_scale) in enumerate(scales):
            self.k_scales[layer].copy_(k_scale)
            self.v_scales[layer].copy_(v_scale)
        self.calibrated = True

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key_storage, *self.value_storage))

    def copy_blocks(self, backend: KernelBackend, src_dst: torch.Tensor) -> None:
        """Copies block src into dst in every layer, K and V (``[n, 2]``
        int64), an int8 block's scales with its values."""
        if len(src_dst):
            backend.copy_blocks(self.key_storage, self.value_storage, src_dst)
