"""The sampling params of the rows a step samples (``RowSamplingParams``):
decode steps sample the same rows step after step, so the batch's params
are built once and kept while no row changes."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from pagedkv.executor.rows import Rows, to_device
from pagedkv.executor.sampler import SamplingParamsBatch


class _ParamsCache(NamedTuple):
    """The sampling params last built, for the rows (and their params'
    version) of ``key``; ``minimums``: (index, position from which its
    banned tokens may be sampled, those tokens) of each row with a minimum
    of outputs (``sampling.min_tokens``)."""

    key: tuple[int, bytes]
    params: SamplingParamsBatch
    minimums: list[tuple[int, int, tuple[int, ...]]]


class RowSamplingParams:
    """The params of ``rows``' sampling, on ``device``."""

    def __init__(self, rows: Rows, device: torch.device) -> None:
        self.rows = rows
        self.device = device
        self._cache: _ParamsCache | None = None

    def get(self, rows: np.ndarray, positions: np.ndarray) -> SamplingParamsBatch:
        """The params of ``rows`` sampling at ``positions``. Decode steps
        sample the same rows step after step: their params are built once
        and kept while no row changes (only seeded rows read the positions,
        which then go to the device each step, and rows with a minimum of
        outputs not reached, whose banned tokens are set each step)."""
        key = (self.rows.sampling_version, rows.tobytes())
        cached = self._cache
        if cached is not None and cached.key == key:
            params = cached.params
            if params.any_seeded:
                params = dataclasses.replace(params, positions=to_device(positions, self.device))
        else:
            params = self._build(rows, positions)
            minimums = [
                (i, s.min_tokens_until, s.min_tokens_ids)
                for i, row in enumerate(rows.tolist())
                if (s := self.rows.sampling[row]) is not None and s.min_tokens_ids
            ]
            cached = self._cache = _ParamsCache(key, params, minimums)
        if cached.minimums or params.num_banned:
            params = params.with_banned(
                [(i, ids) for i, until, ids in cached.minimums if positions[i] < until]
            )
        return params

    def _build(self, rows: np.ndarray, positions: np.ndarray) -> SamplingParamsBatch:
        sampling = [self.rows.sampling[row] for row in rows.tolist()]
        if any(s is None for s in sampling):  # scratch rows of the warm-up
            return SamplingParamsBatch.build(
                temperature=[0.0] * len(rows),
                top_k=[0] * len(rows),
                top_p=[1.0] * len(rows),
                seeds=[None] * len(rows),
                positions=positions.tolist(),
                device=self.device,
            )
        return SamplingParamsBatch.build(
            temperature=[s.temperature for s in sampling if s],
            top_k=[s.top_k for s in sampling if s],
            top_p=[s.top_p for s in sampling if s],
            seeds=[s.seed for s in sampling if s],
            positions=positions.tolist(),
            max_num_logprobs=max((s.num_logprobs for s in sampling if s), default=0),
            device=self.device,
        )
