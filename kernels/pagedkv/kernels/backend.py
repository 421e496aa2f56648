"""Choosing the kernels: Triton launchers or the batched torch ops, by name.

``get_backend("triton")`` imports the Triton modules only when called, so a
process that picks ``"torch"`` never imports them (and tests can set
``TRITON_INTERPRET`` before they are first imported).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from pagedkv.kernels.decode_split import DecodeSplit, TiledDecodes

BACKEND_NAMES = ("triton", "torch")


class ReshapeAndCache(Protocol):
    """Writes each token's K and V at its slot; negative slots are skipped.
    An fp8 cache takes its scales (``k_scale``, ``v_scale``: float32 ``[1]``
    or ``[num_kv_heads]``, ``pagedkv.kernels.fp8_kv``); so do the other ops
    that write or read a cache."""

    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
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
        tiles: torch.Tensor | None = None,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        split: DecodeSplit | TiledDecodes | None = None,
    ) -> torch.Tensor: ...


class BlockRows(Protocol):
    """Moves whole blocks between ``caches`` and rows of a host tier's
    layout (``reference.gather_blocks`` / ``scatter_blocks``)."""

    def __call__(
        self, caches: Sequence[torch.Tensor], block_ids: torch.Tensor, rows: torch.Tensor, /
    ) -> None: ...


class CopyBlocks(Protocol):
    """Copies block ``src`` into block ``dst`` in every layer, K and V."""

    def __call__(
        self,
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        src_dst: torch.Tensor,
    ) -> None: ...


class RmsNorm(Protocol):
    """``weight * rmsnorm(x)`` per row of ``x`` ``[num_tokens, hidden_size]``."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


class AddRmsNorm(Protocol):
    """``(weight * rmsnorm(x + residual), x + residual)``."""

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ActMul(Protocol):
    """``act(gate) * up`` for ``gate_up`` ``[num_tokens, 2 * size]`` (gate first):
    ``silu_mul`` (SiLU) and ``gelu_tanh_mul`` (GELU's tanh approximation)."""

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class RotaryAndCache(Protocol):
    """Rotates the query in place; writes the rotated key and the value at
    their slots; with ``rotate``, the query and key in the Hadamard basis."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos_sin: torch.Tensor,
        positions: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        rotate: bool = False,
    ) -> None: ...


class RotaryDecodeAttention(Protocol):
    """``rotary_and_cache`` then ``paged_attention`` for one-token decodes, the
    query left unchanged."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos_sin: torch.Tensor,
        positions: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        max_seq_len: int | None = None,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        rotate: bool = False,
    ) -> torch.Tensor: ...


class DecodeInputs(NamedTuple):
    """A decode step's forward inputs (``decode_inputs``)."""

    input_ids: torch.Tensor  # int64 [num_entries]
    positions: torch.Tensor  # int64 [num_entries]: clamped at 0
    seq_lens: torch.Tensor  # int32 [num_entries]: position + 1
    block_tables: torch.Tensor  # int32 [num_groups, num_entries, num_columns]
    slot_mappings: torch.Tensor  # int64 [num_groups, num_entries]: -1 for padding


class DecodeInputsOp(Protocol):
    """A decode step's forward inputs from the rows' histories and tables."""

    def __call__(
        self,
        rows: torch.Tensor,
        raw_positions: torch.Tensor,
        token_ids: torch.Tensor,
        block_tables: torch.Tensor,
        num_columns: int,
        block_size: int,
    ) -> DecodeInputs: ...


class GreedySample(Protocol):
    """Each row's argmax of float ``logits`` ``[N, vocab]`` (ties to the lowest
    id) as int64, and its float32 log-probability under the row's softmax."""

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class KernelBackend:
    """The kernels of one implementation; contracts in ``pagedkv.kernels.reference``.

    The first four serve any model's attention; the next five are the fused
    decoder-layer ops (``pagedkv.executor.fused_model``; the fifth is the
    fourth and the attention in one, for one-token decodes);
    ``decode_inputs`` builds a decode graph's inputs; ``greedy_sample``
    samples an all-greedy batch; ``gather_blocks`` and ``scatter_blocks``
    move whole blocks to and from a host tier's rows.
    """

    name: str
    reshape_and_cache: ReshapeAndCache
    compute_slot_mapping: ComputeSlotMapping
    paged_attention: PagedAttention
    copy_blocks: CopyBlocks
    rms_norm: RmsNorm
    add_rms_norm: AddRmsNorm
    silu_mul: ActMul
    gelu_tanh_mul: ActMul
    rotary_and_cache: RotaryAndCache
    rotary_decode_attention: RotaryDecodeAttention
    decode_inputs: DecodeInputsOp
    greedy_sample: GreedySample
    gather_blocks: BlockRows
    scatter_blocks: BlockRows


def get_backend(name: str) -> KernelBackend:
    """The backend called ``name``, one of ``BACKEND_NAMES``; ValueError otherwise.

    ``"triton"`` needs a GPU (or ``TRITON_INTERPRET=1``); ``"torch"`` runs on
    any device.
    """
    if name == "triton":
        from pagedkv.kernels import cache_ops, decode_inputs, greedy, norm_act, rotary, slot_mapping
        from pagedkv.kernels import paged_attention as attention

        return KernelBackend(
            name=name,
            reshape_and_cache=cache_ops.reshape_and_cache,
            compute_slot_mapping=slot_mapping.compute_slot_mapping,
            paged_attention=attention.paged_attention,
            copy_blocks=cache_ops.copy_blocks,
            rms_norm=norm_act.rms_norm,
            add_rms_norm=norm_act.add_rms_norm,
            silu_mul=norm_act.silu_mul,
            gelu_tanh_mul=norm_act.gelu_tanh_mul,
            rotary_and_cache=rotary.rotary_and_cache,
            rotary_decode_attention=attention.rotary_decode_attention,
            decode_inputs=decode_inputs.decode_inputs,
            greedy_sample=greedy.greedy_sample,
            gather_blocks=cache_ops.gather_blocks,
            scatter_blocks=cache_ops.scatter_blocks,
        )
    if name == "torch":
        from pagedkv.kernels import torch_backend

        return KernelBackend(
            name=name,
            reshape_and_cache=torch_backend.reshape_and_cache,
            compute_slot_mapping=torch_backend.compute_slot_mapping,
            paged_attention=torch_backend.paged_attention,
            copy_blocks=torch_backend.copy_blocks,
            rms_norm=torch_backend.rms_norm,
            add_rms_norm=torch_backend.add_rms_norm,
            silu_mul=torch_backend.silu_mul,
            gelu_tanh_mul=torch_backend.gelu_tanh_mul,
            rotary_and_cache=torch_backend.rotary_and_cache,
            rotary_decode_attention=torch_backend.rotary_decode_attention,
            decode_inputs=torch_backend.decode_inputs,
            greedy_sample=torch_backend.greedy_sample,
            gather_blocks=torch_backend.gather_blocks,
            scatter_blocks=torch_backend.scatter_blocks,
        )
    raise ValueError(f"kernel backend: {name!r} is not one of {BACKEND_NAMES}")
