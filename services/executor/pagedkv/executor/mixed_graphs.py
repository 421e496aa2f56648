"""Mixed steps (prompt chunks beside decodes) replayed from captured CUDA graphs.

An eager forward launches each of its kernels from the host, some ten per
layer, and a step that admits a request (its prompt's uncached tokens beside
the running decodes) is as slow as the host is: on the H200 such a step of
the 8B shape took 13-21 ms against 6 ms for a decode step, and one of the
~1.1B model about 13 ms whatever its tokens (docs/memory.md, "The host
tier"). ``MixedGraphs`` captures the packed forward once per token count in
``TOKEN_SIZES`` up to the step's token limit (at most ``TOKEN_SIZES[-1]``),
each for up to
``min(max_entries, tokens)`` entries: the gather of the input tokens and
block tables, the slot mappings, the model and its LM head at each entry's
sampled token. A step that the decode graphs do not take and whose tokens
fit copies its index vectors into the smallest such graph's input buffer
(one copy from pinned memory) and replays it. Padding tokens sit at
position -1: they read row 0's first token and write no K/V (slot -1), and
padding entries have no tokens. The attention reads its schedule from the
buffer too (``paged_attention``'s ``tiles``: each program's sequence and
query tile, the longest reaches first), so its grid is fixed however the
tokens split between entries. Where attention takes a step's leading
decodes in a launch of their own (``splits_decodes``, as the eager steps
do), each graph holds that launch too, over its first ``entries`` tokens
and sized for any context (``TiledDecodes``): the buffer gives each slot's
length (the leading decodes' own, 1 for the rest), and the schedule leaves
those decodes out. Packed, each decode would take a prefill tile of its
own and walk its whole context in one program.

A host tier's load lands chunk by chunk of layers (host_kv.py), and a
graph has no hook between its layers: so each token count's forward is
captured as consecutive segments, a new one starting where a chunk's first
layer reaches its attention (``starts``: the chunks' first layers). Before
replaying a segment the runner lands the chunks it reads (``before_layer``:
the compute stream waits for that chunk's copy alone), so a step's loads
overlap its own forward, not only the steps before it.

``MixedGraphs(..., capture=False)`` runs the same padded forward without
capturing it, so the CPU tests check its inputs against the eager path.
Only on CUDA with the Triton kernels, as the decode graphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pagedkv.common.logging import get_logger
from pagedkv.executor.cuda_graphs import GraphRunner
from pagedkv.executor.entry_order import leading_decodes
from pagedkv.kernels.decode_split import TiledDecodes

log = get_logger(__name__)

TOKEN_SIZES = (32, 64, 96, 128, 192, 256, 384, 512, 640, 768, 896, 1024)
"""A step replays the smallest graph that holds its tokens, and its padding
tokens cost the matmuls as much as real ones: the sizes are at most 128
apart past 256. Longer steps stay eager: their launches hide behind the
device's work. (Powers of two up to 2,048 made the 8B shape's prompt steps
of ~1,200 tokens 29% slower on the H200: serve-host-tier-off-8b-graphs2048.)"""


def tile_schedule(
    num_computed: np.ndarray, num_scheduled: np.ndarray, rows_per_tile: int, num_tiles: int
) -> np.ndarray:
    """``[2, num_tiles]``: every query tile of every entry once (entry, tile
    within it), those whose last query reaches furthest first, then -1s."""
    counts = -(-num_scheduled // rows_per_tile)
    total = int(counts.sum())
    assert total <= num_tiles
    entries = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    tiles = np.arange(total) - np.repeat(starts, counts)
    reach = num_computed[entries] + np.minimum((tiles + 1) * rows_per_tile, num_scheduled[entries])
    order = np.argsort(-reach, kind="stable")
    schedule = np.full((2, num_tiles), -1, dtype=np.int64)
    schedule[0, :total] = entries[order]
    schedule[1, :total] = tiles[order]
    return schedule


@dataclass
class _Graph:
    """One token count's static inputs (int64, on the device), its graph and logits."""

    tokens: int
    entries: int
    rows_per_tile: int
    num_tiles: int
    inputs: torch.Tensor
    segments: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # one per start
    logits: torch.Tensor | None = None

    @property
    def layout(self) -> tuple[int, ...]:
        """Lengths of the buffer's vectors: entries' rows, tokens' rows,
        tokens' positions, entries' sequence lengths, query starts, sample
        indices, sampled rows, the attention's schedule, the decode slots'
        lengths."""
        t, e = self.tokens, self.entries
        return (e, t, t, e, e + 1, e, e, 2 * self.num_tiles, e)

    def split(self, host: np.ndarray) -> list[np.ndarray]:
        """``host`` (the buffer's host copy) as views of the layout's vectors."""
        return np.split(host, np.cumsum(self.layout)[:-1])

    def views(self) -> list[torch.Tensor]:
        out, start = [], 0
        for length in self.layout:
            out.append(self.inputs[start : start + length])
            start += length
        return out


def graph_token_sizes(max_tokens: int) -> list[int]:
    """The token counts ``MixedGraphs`` captures for steps of at most
    ``max_tokens``; each graph samples at most ``min(max_entries, tokens)``
    entries."""
    top = min(max_tokens, TOKEN_SIZES[-1])
    return [t for t in TOKEN_SIZES if t < top] + [top]


class MixedGraphs:
    """One captured packed forward per token count up to ``max_tokens``."""

    def __init__(
        self,
        runner: GraphRunner,
        max_tokens: int,
        max_entries: int,
        capture: bool = True,
        starts: Sequence[int] = (0,),
    ) -> None:
        """``starts``: the first layers of the segments, 0 first (a host
        tier's ``chunk_starts``)."""
        from pagedkv.kernels.paged_attention import tile_rows  # after TRITON_INTERPRET is set

        assert starts and starts[0] == 0 and list(starts) == sorted(set(starts))
        self.runner = runner
        self.starts = tuple(starts)
        self.splits_decodes = runner.splits_decodes
        sizes = graph_token_sizes(max_tokens)
        head_size = runner.spec.head_size
        self.graphs: list[_Graph] = []
        for tokens in sizes:
            entries = min(max_entries, tokens)
            rows = tile_rows(tokens, head_size)
            num_tiles = -(-tokens // rows) + entries
            graph = _Graph(tokens, entries, rows, num_tiles, torch.empty(0))
            graph.inputs = torch.from_numpy(self._padding(graph)).to(runner.device)
            self.graphs.append(graph)
        if capture:
            self._capture()

    @property
    def sizes(self) -> list[int]:
        return [g.tokens for g in self.graphs]

    def fits(self, num_scheduled: np.ndarray) -> bool:
        """Whether a step's tokens (and so its entries) fit a graph."""
        return 0 < int(num_scheduled.sum()) <= self.graphs[-1].tokens

    def run(
        self,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        needs_sample: np.ndarray,
        before_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """The forward of tokens ``[c, c + s)`` of each of ``rows`` (already
        in the rows' histories); the logits of the entries that sample, in
        the model's dtype (a view of the graph's output, valid until its
        next replay), their rows on the device and their sample positions.
        ``before_layer(start)`` is called before each segment's replay (and
        before each layer's attention when uncaptured)."""
        num_tokens = int(num_scheduled.sum())
        graph = next(g for g in self.graphs if g.tokens >= num_tokens)
        host = self._padding(graph)
        (
            rows_v,
            token_rows,
            positions,
            seq_lens,
            starts,
            sample_index,
            sampled,
            tiles,
            decode_lens,
        ) = graph.split(host)
        count = len(rows)
        rows_v[:count] = rows
        np.cumsum(num_scheduled, out=starts[1 : count + 1])
        starts[count + 1 :] = num_tokens
        positions[:num_tokens] = np.repeat(num_computed - starts[:count], num_scheduled)
        positions[:num_tokens] += np.arange(num_tokens)
        token_rows[:num_tokens] = np.repeat(rows, num_scheduled)
        seq_lens[:count] = num_computed + num_scheduled
        num_samples = int(needs_sample.sum())
        sample_index[:num_samples] = starts[1 : count + 1][needs_sample] - 1
        sampled[:num_samples] = rows[needs_sample]
        tiled = num_scheduled
        if self.splits_decodes:  # the leading decodes take the decode launch
            decodes = leading_decodes(num_scheduled)
            decode_lens[:decodes] = seq_lens[:decodes]
            tiled = np.concatenate([np.zeros(decodes, np.int64), num_scheduled[decodes:]])
        schedule = tile_schedule(num_computed, tiled, graph.rows_per_tile, graph.num_tiles)
        tiles[:] = schedule.reshape(-1)
        source = torch.from_numpy(host)
        if graph.inputs.device.type == "cuda":
            source = source.pin_memory()
        graph.inputs.copy_(source, non_blocking=True)
        if graph.segments:
            for start, segment in zip(self.starts, graph.segments, strict=True):
                if before_layer is not None:
                    before_layer(start)
                segment.replay()
            logits = graph.logits
        else:
            logits = self._forward(graph, before_layer)
        assert logits is not None
        sampled_rows = graph.views()[6][:num_samples]
        return logits[:num_samples], sampled_rows, (num_computed + num_scheduled)[needs_sample]

    def _padding(self, graph: _Graph) -> np.ndarray:
        """The input buffer of a step with no entries: every token padding,
        no tile scheduled, every decode slot one token long."""
        host = np.zeros(sum(graph.layout), dtype=np.int64)
        _, _, positions, _, _, _, _, tiles, decode_lens = graph.split(host)
        positions[:] = -1
        tiles[: graph.num_tiles] = -1
        decode_lens[:] = 1
        return host

    def _capture(self) -> None:
        device = self.runner.device
        begun = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for graph in reversed(self.graphs):  # the largest first: the others reuse its memory
                self._forward(graph)  # compiles and settles the allocator outside the capture
                torch.cuda.synchronize(device)
                graph.segments = [torch.cuda.CUDAGraph()]
                graph.segments[0].capture_begin(pool=pool)

                def split(
                    layer: int, segments: list[torch.cuda.CUDAGraph] = graph.segments
                ) -> None:
                    if layer in self.starts[1:]:  # a new segment from this layer's attention on
                        segments[-1].capture_end()
                        segments.append(torch.cuda.CUDAGraph())
                        segments[-1].capture_begin(pool=pool)

                graph.logits = self._forward(graph, split)
                graph.segments[-1].capture_end()
                assert len(graph.segments) == len(self.starts)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        log.info(
            "mixed-step graphs captured",
            token_sizes=self.sizes,
            segments=len(self.starts),
            seconds=round(time.perf_counter() - begun, 2),
        )

    def _forward(
        self, graph: _Graph, before_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        runner = self.runner
        rows, token_rows, raw_positions, seq_lens, starts, sample_index, _, tiles, decode_lens = (
            graph.views()
        )
        positions = raw_positions.clamp(min=0)
        input_ids, meta = runner.forward_inputs.build(
            rows,
            token_rows,
            positions,
            seq_lens.to(torch.int32),
            starts.to(torch.int32),
            num_columns=runner.max_blocks_per_row,
            max_query_len=graph.tokens,
            max_seq_len=runner.spec.max_model_len,
        )
        padding = raw_positions < 0
        meta = replace(
            meta,
            slot_mappings=tuple(s.masked_fill(padding, -1) for s in meta.slot_mappings),
            tiles=tiles.to(torch.int32).view(2, -1),
            before_layer=before_layer,
        )
        if self.splits_decodes:
            decodes = TiledDecodes(
                graph.entries, decode_lens.to(torch.int32), runner.spec.max_model_len
            )
            meta = replace(meta, splits=(decodes,) * len(meta.block_tables))
        return runner.run_model(input_ids, positions, meta, sample_index)
