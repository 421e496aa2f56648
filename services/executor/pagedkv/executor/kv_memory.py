"""The executor's KV memory: K and V tensors per layer, in the kernels' layout
``[num_blocks, block_size, num_kv_heads, head_size]``.

Block ids are one space for every group: block ``b`` of a group's table
addresses index ``b`` of that group's layers' tensors. So one block id
accounts for ``page_size_bytes`` in every layer of every group
(``bytes_per_block``). Block 0 is the null block: never written by a real
token (the scheduler never hands it out for one).
"""

from __future__ import annotations

import torch

from pagedkv.executor.model_spec import KVCacheGroup
from pagedkv.kernels.backend import KernelBackend


def bytes_per_block(groups: tuple[KVCacheGroup, ...]) -> int:
    """Device bytes one block id accounts for, over all groups' layers."""
    return sum(group.spec.page_size_bytes * len(group.layer_indices) for group in groups)


class KVMemory:
    """``num_blocks`` blocks for every layer of ``groups``, K and V, zeroed."""

    def __init__(
        self,
        groups: tuple[KVCacheGroup, ...],
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        num_layers = sum(len(group.layer_indices) for group in groups)
        self.groups = groups
        self.num_blocks = num_blocks
        self.layer_groups = [0] * num_layers
        keys: list[torch.Tensor | None] = [None] * num_layers
        values: list[torch.Tensor | None] = [None] * num_layers
        for g, group in enumerate(groups):
            spec = group.spec
            shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            for layer in group.layer_indices:
                self.layer_groups[layer] = g
                keys[layer] = torch.zeros(shape, dtype=dtype, device=device)
                values[layer] = torch.zeros(shape, dtype=dtype, device=device)
        assert all(k is not None for k in keys), "every layer belongs to a group"
        self.key_caches: tuple[torch.Tensor, ...] = tuple(k for k in keys if k is not None)
        self.value_caches: tuple[torch.Tensor, ...] = tuple(v for v in values if v is not None)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key_caches, *self.value_caches))

    def copy_blocks(self, backend: KernelBackend, src_dst: torch.Tensor) -> None:
        """Copies block src into dst in every layer, K and V (``[n, 2]`` int64)."""
        if len(src_dst):
            backend.copy_blocks(self.key_caches, self.value_caches, src_dst)
