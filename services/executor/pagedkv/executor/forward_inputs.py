"""A packed forward's device inputs: the one builder of the eager path and of
the CUDA graphs.

``InputBuilder.build`` turns a forward's index vectors on the device (each
entry's row, each token's row and position, the entries' sequence lengths
and query starts) into the input token ids, read from the rows' histories,
and the attention metadata: each group's block tables gathered for the
entries, the slot mappings, the caches. The eager path (``prepare``)
computes the index vectors on the host and sends them in one copy; the CUDA
graphs (cuda_graphs.py) run ``build_decode``, the same for one-token decodes
in one launch, inside their capture on their static input buffer, with
padding entries whose slots are -1. Reads ``Rows``, changes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.executor.attention import AttentionMetadata
from pagedkv.executor.entry_order import leading_decodes
from pagedkv.executor.kv_memory import KVMemory
from pagedkv.executor.model_spec import KVCacheGroup
from pagedkv.executor.rows import Rows, to_device
from pagedkv.kernels.backend import KernelBackend
from pagedkv.kernels.decode_split import DecodeSplit


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    """What one packed forward reads, on the device (plus host sample positions)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    sample_index: torch.Tensor  # [num_samples]: packed index of each sampled token
    sample_positions: np.ndarray  # [num_samples]: position of the token to sample
    sampled_rows: torch.Tensor  # [num_samples]
    metadata: AttentionMetadata


ALIGN_ELEMENTS = 2
"""int64 elements in 16 bytes: Triton compiles a kernel once per pointer
argument aligned to 16 bytes and once per one that is not."""


def pack_aligned(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (integers) on ``device`` as int64 views of one host-to-device
    copy, each starting 16 bytes aligned, so that a kernel reading any of
    them meets one alignment whatever the lengths before it."""
    offsets = [0]
    for array in arrays:
        offsets.append(offsets[-1] + -(-len(array) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS)
    host = np.zeros(offsets[-1], dtype=np.int64)
    for array, start in zip(arrays, offsets, strict=False):
        host[start : start + len(array)] = array
    packed = to_device(host, device)
    return [packed[start : start + len(a)] for a, start in zip(arrays, offsets, strict=False)]


def _splits_decodes(backend: KernelBackend) -> bool:
    """Whether attention takes a step's leading decodes in a launch of their
    own: Triton's paged attention, with its ``PREFILL_SPLIT_DECODES`` on
    (the torch backend computes a batch at once)."""
    if backend.name != "triton":
        return False
    from pagedkv.kernels import paged_attention  # the backend imported it

    return paged_attention.PREFILL_SPLIT_DECODES


class InputBuilder:
    """The forward inputs over one executor's rows and KV memory."""

    def __init__(
        self,
        rows: Rows,
        kv: KVMemory,
        groups: tuple[KVCacheGroup, ...],
        backend: KernelBackend,
        block_size: int,
        softcap: float | None,
    ) -> None:
        self.rows = rows
        self.kv = kv
        self.backend = backend
        self.block_size = block_size
        self.softcap = softcap
        self.num_groups = len(groups)
        self.group_windows = tuple(g.spec.sliding_window for g in groups)
        self.splits_decodes = _splits_decodes(backend)

    def build(
        self,
        rows: torch.Tensor,  # int64 [num_seqs]: each entry's row
        token_rows: torch.Tensor,  # int64 [num_tokens]: each token's row
        positions: torch.Tensor,  # int64 [num_tokens]
        seq_lens: torch.Tensor,  # int32 [num_seqs]: tokens of each entry after the forward
        query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
        *,
        num_columns: int,  # block-table columns to gather (covers max_seq_len)
        max_query_len: int,
        max_seq_len: int,
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The input token ids ``[num_tokens]`` and the attention metadata."""
        block_tables = tuple(
            self.rows.block_tables[g, :, :num_columns].index_select(0, rows)
            for g in range(self.num_groups)
        )
        slot_mappings = [
            self.backend.compute_slot_mapping(
                query_start_loc, positions, table, self.block_size, max_query_len
            )
            for table in block_tables
        ]
        meta = self._metadata(
            block_tables,
            tuple(slot_mappings),
            seq_lens,
            query_start_loc,
            max_query_len,
            max_seq_len,
        )
        return self.rows.token_ids[token_rows, positions], meta

    def build_decode(
        self,
        rows: torch.Tensor,  # int64 [num_seqs]: each entry's row
        raw_positions: torch.Tensor,  # int64 [num_seqs]: its new token's (-1: padding)
        query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]: 0, 1, 2, ...
        *,
        num_columns: int,
        max_seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``build`` for one-token decodes, padding entries reading row 0's
        first token and writing no K/V, in the backend's one launch
        (``decode_inputs``); the input ids, the (clamped) positions and the
        metadata."""
        inputs = self.backend.decode_inputs(
            rows,
            raw_positions,
            self.rows.token_ids,
            self.rows.block_tables,
            num_columns,
            self.block_size,
        )
        meta = self._metadata(
            tuple(inputs.block_tables.unbind(0)),
            tuple(inputs.slot_mappings.unbind(0)),
            inputs.seq_lens,
            query_start_loc,
            1,
            max_seq_len,
        )
        return inputs.input_ids, inputs.positions, meta

    def _metadata(
        self,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: tuple[torch.Tensor, ...],
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
    ) -> AttentionMetadata:
        return AttentionMetadata(
            backend=self.backend,
            key_caches=self.kv.key_caches,
            value_caches=self.kv.value_caches,
            layer_groups=tuple(self.kv.layer_groups),
            group_windows=self.group_windows,
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            softcap=self.softcap,
            k_scales=self.kv.k_scales,
            v_scales=self.kv.v_scales,
            rotation=self.kv.rotation,
        )

    def _leading_decodes(self, num_scheduled: np.ndarray) -> int:
        """How many entries at the start of an eager step are one-token
        decodes, where attention takes them in a launch of their own
        (``DecodeSplit``: prompts after them, on the Triton backend); else 0."""
        if not self.splits_decodes or num_scheduled.max() == 1:
            return 0
        return leading_decodes(num_scheduled)

    def prepare(
        self,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        needs_sample: np.ndarray,
    ) -> ForwardInputs:
        """The eager path: tokens ``[c, c + s)`` of each of ``rows``; the
        index vectors go to the device in one copy, each 16 bytes aligned,
        and the block tables are gathered at their full width (as the decode
        graphs gather them): the kernels' integer and pointer arguments then
        fall in the same specialization whatever the step's lengths, and no
        step compiles a variant the warm-up did not (warm_up.py)."""
        num_seqs = len(rows)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        positions = np.repeat(num_computed - query_start_loc[:-1], num_scheduled) + np.arange(
            num_tokens
        )
        seq_lens = num_computed + num_scheduled
        max_seq_len = int(seq_lens.max())
        sample_index = query_start_loc[1:][needs_sample] - 1
        sampled_rows = rows[needs_sample]
        decodes = self._leading_decodes(num_scheduled)
        rest_qsl = query_start_loc[decodes:] - query_start_loc[decodes]
        packed = pack_aligned(
            [
                rows,
                np.repeat(rows, num_scheduled),
                positions,
                seq_lens,
                query_start_loc,
                sample_index,
                sampled_rows,
                *((rows[decodes:], seq_lens[decodes:], rest_qsl) if decodes else ()),
            ],
            self.rows.device,
        )
        rows_t, token_rows_t, positions_t, seq_lens_t, qsl_t, sample_index_t, sampled_t = packed[:7]
        input_ids, meta = self.build(
            rows_t,
            token_rows_t,
            positions_t,
            seq_lens_t.to(torch.int32),
            qsl_t.to(torch.int32),
            num_columns=self.rows.block_tables.shape[2],
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max_seq_len,
        )
        if decodes:
            rest_rows_t, rest_seq_lens_t, rest_qsl_t = packed[7:]
            rest_seq_lens_t, rest_qsl_t = (
                rest_seq_lens_t.to(torch.int32),
                rest_qsl_t.to(torch.int32),
            )
            splits = tuple(
                DecodeSplit(
                    num_decodes=decodes,
                    decode_max_seq_len=int(seq_lens[:decodes].max()),
                    block_table=self.rows.block_tables[g].index_select(0, rest_rows_t),
                    seq_lens=rest_seq_lens_t,
                    query_start_loc=rest_qsl_t,
                    max_query_len=int(num_scheduled[decodes:].max()),
                    max_seq_len=int(seq_lens[decodes:].max()),
                )
                for g in range(self.num_groups)
            )
            meta = dataclasses.replace(meta, splits=splits)
        return ForwardInputs(
            input_ids=input_ids,
            positions=positions_t,
            sample_index=sample_index_t,
            sample_positions=seq_lens[needs_sample],
            sampled_rows=sampled_t,
            metadata=meta,
        )
