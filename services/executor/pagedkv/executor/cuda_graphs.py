"""Decode steps replayed from captured CUDA graphs.

In eager mode the host launches every kernel of the model one by one, tens
per layer, and a decode step of a 1B model spends most of its time there.
``DecodeGraphs`` captures the whole decode forward once per batch size in
``BATCH_SIZES`` (up to the executor's limits): the gather of the input tokens
and block tables, the slot mappings, the model and its LM head. A step in
which every entry decodes one token and samples copies its rows and
positions into the graphs' input buffer and replays the smallest graph that
holds it; the later steps of a decode window advance those positions on the
device and replay the same graph (``run_next``). Padding entries read row 0
at position 0 and write no K/V (slot -1); their logits are dropped.
Attention is sized for ``max_model_len``, so a graph serves any context.

Only on CUDA with the Triton kernels: the torch backend waits for the host.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import torch

from pagedkv.common.logging import get_logger
from pagedkv.executor import attention
from pagedkv.executor.forward_inputs import InputBuilder
from pagedkv.executor.model_spec import ModelSpec
from pagedkv.executor.rows import Rows


class GraphRunner(Protocol):
    """What the decode graphs need of the model runner (``ModelRunner``)."""

    @property
    def device(self) -> torch.device: ...
    @property
    def rows(self) -> Rows: ...
    @property
    def forward_inputs(self) -> InputBuilder: ...
    @property
    def max_blocks_per_row(self) -> int: ...
    @property
    def spec(self) -> ModelSpec: ...
    @property
    def splits_decodes(self) -> bool: ...
    def run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: attention.AttentionMetadata,
        sample_index: torch.Tensor | None,
    ) -> torch.Tensor: ...


log = get_logger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes ``DecodeGraphs`` captures for ``max_batch`` rows."""
    return [b for b in BATCH_SIZES if b < max_batch] + [max_batch]


class DecodeGraphs:
    """One captured decode forward per batch size up to ``max_batch``."""

    def __init__(self, runner: GraphRunner, max_batch: int) -> None:
        self.runner = runner
        self.sizes = graph_batch_sizes(max_batch)
        largest = self.sizes[-1]
        device = runner.device
        # Row 0: each entry's row; row 1: the position of its token (-1: padding).
        self.inputs = torch.zeros((2, largest), dtype=torch.int64, device=device)
        self.inputs[1].fill_(-1)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # the largest first: the others reuse its memory
                self._forward(size)  # compiles and settles the allocator outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[size] = self._forward(size)
                self.graphs[size] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        log.info(
            "decode graphs captured",
            batch_sizes=self.sizes,
            seconds=round(time.perf_counter() - start, 2),
        )

    def fits(self, num_scheduled: np.ndarray, needs_sample: np.ndarray) -> bool:
        """Whether a step is all one-token decodes that sample, few enough."""
        return (
            0 < len(num_scheduled) <= self.sizes[-1]
            and bool((num_scheduled == 1).all())
            and bool(needs_sample.all())
        )

    def run(self, rows: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays a graph for one-token decodes of ``rows`` at ``positions``;
        returns the logits ``[len(rows), vocab]`` (in the model's dtype: a view
        of the graph's output, valid until its next replay) and the rows on
        the device."""
        count = len(rows)
        size = next(s for s in self.sizes if s >= count)
        # The whole buffer in one copy from pinned memory (no device-side copy).
        host = np.zeros(self.inputs.shape, dtype=np.int64)
        host[1, count:] = -1
        host[0, :count] = rows
        host[1, :count] = positions
        self.inputs.copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:count], self.inputs[0, :count]

    def run_next(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays the last ``run``'s graph for the next token of each of its
        ``count`` rows (their positions advanced by one on the device: no
        host copy), after ``append`` writes each row's last sample at its new
        position; returns the logits and the rows as ``run`` does."""
        size = next(s for s in self.sizes if s >= count)
        rows, positions = self.inputs[0, :count], self.inputs[1, :count]
        positions.add_(1)
        self.runner.rows.append_samples_on_device(rows, positions)
        self.graphs[size].replay()
        return self.logits[size][:count], rows

    def _forward(self, size: int) -> torch.Tensor:
        runner = self.runner
        input_ids, positions, meta = runner.forward_inputs.build_decode(
            self.inputs[0, :size],
            self.inputs[1, :size],
            self.query_start_loc[: size + 1],
            num_columns=runner.max_blocks_per_row,
            max_seq_len=runner.spec.max_model_len,
        )
        return runner.run_model(input_ids, positions, meta, None)
