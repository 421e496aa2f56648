"""The types of a validated step, apart from the checks that make them
(step_plan.py, step_entries.py, step_tokens.py) and from the rows they
change (rows.py), which both import them: ``Limits`` (what the executor
accepts), ``RowSampling`` (a row's sampling params), ``NewRow`` (a checked
new request) and ``StepPlan`` (a validated message, as arrays)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.common.ids import BlockId
from pagedkv.common.step_contract import ONE_STEP
from pagedkv.executor.block_tags import TagColumns
from pagedkv.v1 import common_pb2

# The empty columns of a plan (shared, never written to).
NO_IDS = np.zeros(0, dtype=np.int64)
NO_PAIRS = np.zeros((0, 2), dtype=np.int64)  # copies, offloads, loads
NO_TAGS = TagColumns((), (), ())


@dataclass(frozen=True, slots=True)
class Limits:
    """What the executor accepts; fixed for its incarnation."""

    num_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_logprobs: int
    group_windowed: tuple[bool, ...]  # per group: sliding window (the null block is allowed)
    eos_token_ids: tuple[int, ...] = ()  # the model's (sampling.min_tokens masks them)
    num_host_blocks: int = 0  # the host tier's blocks (host_kv.py); 0: none


@dataclass(frozen=True, slots=True)
class RowSampling:
    """A row's sampling params, with the wire's unset fields resolved.

    ``min_tokens_ids`` are the tokens a sample at a position below
    ``min_tokens_until`` may not be (``sampling.min_tokens``: the stop
    tokens and, unless ignore_eos, the model's EOS tokens, until the
    sequence has min_tokens outputs); none when the request sets no minimum.
    """

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    num_logprobs: int
    min_tokens_until: int = 0
    min_tokens_ids: tuple[int, ...] = ()

    @classmethod
    def from_proto(
        cls,
        params: common_pb2.SamplingParams,
        eos_token_ids: Sequence[int] = (),
        num_prompt_tokens: int = 0,
    ) -> RowSampling:
        """The params of a sequence whose first output is at position
        ``num_prompt_tokens``, of a model with ``eos_token_ids``."""
        ids: tuple[int, ...] = ()
        if params.min_tokens:
            eos = () if params.ignore_eos else eos_token_ids
            ids = tuple(sorted({*params.stop_token_ids, *eos}))
        return cls(
            temperature=params.temperature if params.HasField("temperature") else 1.0,
            top_p=params.top_p if params.HasField("top_p") else 1.0,
            top_k=params.top_k,
            seed=params.seed if params.HasField("seed") else None,
            num_logprobs=params.logprobs if params.HasField("logprobs") else 0,
            min_tokens_until=num_prompt_tokens + params.min_tokens if ids else 0,
            min_tokens_ids=ids,
        )


@dataclass(frozen=True, slots=True)
class NewRow:
    """A checked new request: the row it takes, its prompt and sampling."""

    row: int
    seq_id: str
    prompt: np.ndarray  # int64 [prompt_len]
    sampling: RowSampling


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A validated message, in the order its effects apply (see executor.proto)."""

    # The host tier's copies first: int64 [n, 2] (block, host block), then
    # int64 [m, 2] (host block, block).
    offloads: np.ndarray
    loads: np.ndarray
    untag_block_ids: Sequence[BlockId]  # their tags go first
    freed_rows: list[int]
    new_rows: list[NewRow]
    # Block-table writes: (group, row, column) <- block id; then each
    # (group, row) gets its new length: table_lengths is [3, n].
    table_groups: np.ndarray
    table_rows: np.ndarray
    table_columns: np.ndarray
    table_block_ids: np.ndarray
    table_lengths: np.ndarray
    copies: np.ndarray  # int64 [num_copies, 2]: (src, dst)
    # Token appends: last samples at (row, position), then host tokens.
    continue_rows: np.ndarray
    continue_positions: np.ndarray
    token_rows: np.ndarray
    token_positions: np.ndarray
    token_values: np.ndarray
    history_rows: np.ndarray  # rows whose history length changes ...
    history_lengths: np.ndarray  # ... to this
    # The forward: entries with tokens to run, in entry order.
    rows: np.ndarray  # int64 [num_run]
    num_computed: np.ndarray  # int64 [num_run]: position of the first token
    num_scheduled: np.ndarray  # int64 [num_run]
    needs_sample: np.ndarray  # bool [num_run]
    tags: TagColumns  # set once the forward and sampling have finished
    num_steps: int = ONE_STEP  # a decode window's steps (see num_decode_steps)

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())
