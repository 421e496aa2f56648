"""Choosing the kernels: Triton launchers or the batched torch ops, by name.

``get_backend("triton")`` imports the Triton modules only when called, so a
process that picks ``"torch"`` never imports them (and tests can set
``TRITON_INTERPRET`` before they are first imported).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

BACKEND_NAMES = ("triton", "torch")


class ReshapeAndCache(Protocol):
    """Writes each token's K and V at its slot; negative slots are skipped."""

    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...


class ComputeSlotMapping(Protocol):
    """The slot (int64) of every packed token."""

    def __call__(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        max_query_len: int | None = None,
    ) -> torch.Tensor: ...


class PagedAttention(Protocol):
    """Causal attention of each sequence's new tokens over its paged K/V."""

    def __call__(
        self,
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
    ) -> torch.Tensor: ...


class CopyBlocks(Protocol):
    """Copies block ``src`` into block ``dst`` in every layer, K and V."""

    def __call__(
        self,
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        src_dst: torch.Tensor,
    ) -> None: ...


@dataclass(frozen=True)
class KernelBackend:
    """The four kernels of one implementation; contracts in ``pagedkv.kernels.reference``."""

    name: str
    reshape_and_cache: ReshapeAndCache
    compute_slot_mapping: ComputeSlotMapping
    paged_attention: PagedAttention
    copy_blocks: CopyBlocks


def get_backend(name: str) -> KernelBackend:
    """The backend called ``name``, one of ``BACKEND_NAMES``; ValueError otherwise.

    ``"triton"`` needs a GPU (or ``TRITON_INTERPRET=1``); ``"torch"`` runs on
    any device.
    """
    if name == "triton":
        from pagedkv.kernels import cache_ops, slot_mapping
        from pagedkv.kernels import paged_attention as attention

        return KernelBackend(
            name=name,
            reshape_and_cache=cache_ops.reshape_and_cache,
            compute_slot_mapping=slot_mapping.compute_slot_mapping,
            paged_attention=attention.paged_attention,
            copy_blocks=cache_ops.copy_blocks,
        )
    if name == "torch":
        from pagedkv.kernels import torch_backend

        return KernelBackend(
            name=name,
            reshape_and_cache=torch_backend.reshape_and_cache,
            compute_slot_mapping=torch_backend.compute_slot_mapping,
            paged_attention=torch_backend.paged_attention,
            copy_blocks=torch_backend.copy_blocks,
        )
    raise ValueError(f"kernel backend: {name!r} is not one of {BACKEND_NAMES}")
