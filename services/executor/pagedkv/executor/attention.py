"""Our attention inside a transformers model: paged K/V, per-step metadata
handed down explicitly.

``register()`` adds ``ATTENTION_NAME`` to transformers' attention interface
and to nothing else: with no mask function under that name, transformers
builds no attention mask (the kernels mask by position) and skips its
packed-sequence check, which would wait for the device every forward. The
model runner passes one frozen ``AttentionMetadata`` per forward as the
keyword argument ``pagedkv_metadata``; transformers hands it to every
attention layer, which writes the step's K/V into its layer's cache and runs
paged attention over the packed batch. Nothing lives in module globals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.executor.kv_rotation import rotate_heads
from pagedkv.kernels.backend import KernelBackend
from pagedkv.kernels.decode_split import DecodeSplit, TiledDecodes

ATTENTION_NAME = "pagedkv"


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One forward's packed batch (tokens of every scheduled entry, in entry order)."""

    backend: KernelBackend
    key_caches: tuple[torch.Tensor, ...]  # per layer [num_blocks, block_size, Hkv, D]
    value_caches: tuple[torch.Tensor, ...]
    layer_groups: tuple[int, ...]  # per layer: its KV cache group
    group_windows: tuple[int | None, ...]  # per group: sliding window
    block_tables: tuple[torch.Tensor, ...]  # per group [num_seqs, max_blocks], int32
    slot_mappings: tuple[torch.Tensor, ...]  # per group [num_tokens], int64
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens with K/V after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    softcap: float | None
    # Called with a layer's index before its attention reads its caches: lands
    # the host tier's loads of that layer (host_kv.py); None: nothing to land.
    before_layer: Callable[[int], None] | None = None
    # The prefill kernel's schedule, on the device (``paged_attention``'s
    # ``tiles``): a CUDA graph's fixed launch over any mix of entries.
    tiles: torch.Tensor | None = None
    # An fp8 memory's scales, per layer (kv_memory.py); None for a float one.
    k_scales: tuple[torch.Tensor, ...] | None = None
    v_scales: tuple[torch.Tensor, ...] | None = None
    # Called with a layer's index and its new K and V (the key before or
    # after the rotary embedding: either does) before they are cached: sets
    # the layer's fp8 scales, on the executor's first forward only.
    calibrate: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    # The Hadamard matrix when K and V are stored in its basis (kv_rotation.py):
    # the query and the new keys are multiplied by it after the rotary
    # embedding; None: stored as they are.
    rotation: torch.Tensor | None = None
    # Per group, where a step has decodes first and prompts after them
    # (``paged_attention``'s ``split``): an eager step's rest of the batch
    # for attention's second launch, or a mixed graph's decode slots
    # (``TiledDecodes``, with ``tiles``); None: one launch.
    splits: tuple[DecodeSplit | TiledDecodes, ...] | None = None

    def scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The cache kernels' ``k_scale`` and ``v_scale`` for ``layer``, if any."""
        if self.k_scales is None or self.v_scales is None:
            return {}
        return {"k_scale": self.k_scales[layer], "v_scale": self.v_scales[layer]}

    def split(self, group: int) -> DecodeSplit | TiledDecodes | None:
        """Group ``group``'s ``splits``, if any."""
        return None if self.splits is None else self.splits[group]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, num_tokens, D]
    key: torch.Tensor,  # [1, Hkv, num_tokens, D]
    value: torch.Tensor,  # [1, Hkv, num_tokens, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The transformers attention function: caches the new K/V, then attends."""
    meta: AttentionMetadata = kwargs["pagedkv_metadata"]
    layer: int = module.layer_idx  # type: ignore[assignment]
    group = meta.layer_groups[layer]
    if meta.before_layer is not None:
        meta.before_layer(layer)
    key_cache, value_cache = meta.key_caches[layer], meta.value_caches[layer]
    q = query[0].transpose(0, 1)  # [T, Hq, D], last dim contiguous
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if meta.calibrate is not None:
        meta.calibrate(layer, k, v)
    if meta.rotation is not None:
        q, k = rotate_heads(q, meta.rotation), rotate_heads(k, meta.rotation)
    scales = meta.scales(layer)
    meta.backend.reshape_and_cache(
        k, v, key_cache, value_cache, meta.slot_mappings[group], **scales
    )
    out = meta.backend.paged_attention(
        q if q.stride(-1) == 1 else q.contiguous(),
        key_cache,
        value_cache,
        meta.block_tables[group],
        meta.seq_lens,
        meta.query_start_loc,
        scaling if scaling is not None else q.shape[-1] ** -0.5,
        sliding_window=meta.group_windows[group],
        softcap=meta.softcap,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        tiles=meta.tiles,
        k_scale=scales.get("k_scale"),
        v_scale=scales.get("v_scale"),
        split=meta.split(group),
    )
    return out[None], None  # [1, T, Hq, D]


def register() -> None:
    """Registers the attention function with transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
