"""The one builder of forward inputs: a CUDA graph's decode forward and a
mixed step's (run here without capture, on the CPU) give the eager path's
logits for the same entries, and their padding writes no K/V."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.executor import entry_order
from pagedkv.executor.cuda_graphs import DecodeGraphs
from pagedkv.executor.mixed_graphs import MixedGraphs, tile_schedule
from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.runner_config import RunnerConfig
from pagedkv.executor.sampler import SamplerOutput
from pagedkv.executor.tiny_model import make_tiny_model
from tests.kernels.test_decode_split import decode_launches

BLOCKS_PER_ROW = 4
PROMPT_LEN = 21


@pytest.fixture(scope="module", params=["torch", "triton"])
def runner(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> ModelRunner:
    model = Path(tmp_path_factory.mktemp("model"))
    make_tiny_model(model, "llama", seed=5)
    config = RunnerConfig(
        model=str(model),
        device="cpu",
        kernel_backend=request.param,
        num_blocks=1 + 3 * BLOCKS_PER_ROW,
        max_num_rows=4,
        max_num_batched_tokens=64,
    )
    runner = ModelRunner(config)
    rows = np.arange(3)
    runner.rows.fill_tables(1 + rows[:, None] * BLOCKS_PER_ROW + np.arange(BLOCKS_PER_ROW))
    tokens = np.random.default_rng(1).integers(3, 200, size=(3, PROMPT_LEN + 1))
    positions = np.tile(np.arange(PROMPT_LEN + 1), 3)
    runner.rows.write_tokens(np.repeat(rows, PROMPT_LEN + 1), positions, tokens.reshape(-1))
    inputs = runner.forward_inputs.prepare(
        rows, np.zeros(3, np.int64), np.full(3, PROMPT_LEN), np.ones(3, bool)
    )
    assert runner.logits(inputs) is not None  # the prompts' K/V are in the cache
    return runner


def _graph_forward(runner: ModelRunner, rows: list[int], positions: list[int]) -> torch.Tensor:
    """A decode graph's forward at size 4, eagerly: the entries, then padding."""
    graphs = object.__new__(DecodeGraphs)
    graphs.runner = runner
    graphs.inputs = torch.full((2, 4), -1, dtype=torch.int64)
    graphs.inputs[0, : len(rows)] = torch.tensor(rows)
    graphs.inputs[0, len(rows) :] = 0
    graphs.inputs[1, : len(positions)] = torch.tensor(positions)
    graphs.query_start_loc = torch.arange(5, dtype=torch.int32)
    return graphs._forward(4)


def test_a_graph_decode_gives_the_eager_logits_and_its_padding_writes_no_kv(
    runner: ModelRunner,
) -> None:
    rows = np.array([2, 1])
    inputs = runner.forward_inputs.prepare(
        rows, np.full(2, PROMPT_LEN), np.ones(2, np.int64), np.ones(2, bool)
    )
    eager = runner.logits(inputs)
    assert eager is not None
    # Padding entries read row 0 at position 0: had they written K/V, it
    # would land in row 0's first slot (block 1, offset 0), marked here.
    caches = runner.kv.key_caches + runner.kv.value_caches
    for cache in caches:
        cache[1, 0] = 123.0
    graph = _graph_forward(runner, [2, 1], [PROMPT_LEN, PROMPT_LEN])
    assert graph.shape[0] == 4
    torch.testing.assert_close(graph[:2].float(), eager, atol=1e-5, rtol=1e-5)
    for cache in caches:
        assert bool((cache[1, 0] == 123.0).all())


def eager_logits_marking_padding(
    runner: ModelRunner,
    rows: np.ndarray,
    computed: np.ndarray,
    scheduled: np.ndarray,
    sample: np.ndarray,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The eager step's logits, and the caches with 123 where a graph's
    padding (row 0, position 0: block 1, offset 0) would write K/V."""
    inputs = runner.forward_inputs.prepare(rows, computed, scheduled, sample)
    eager = runner.logits(inputs)
    assert eager is not None
    caches = runner.kv.key_caches + runner.kv.value_caches
    for cache in caches:
        cache[1, 0] = 123.0
    return eager, caches


@pytest.mark.parametrize("needs_sample", [[True, True], [False, True]])
def test_a_mixed_graph_gives_the_eager_logits_and_its_padding_writes_no_kv(
    runner: ModelRunner, needs_sample: list[bool]
) -> None:
    # Row 1 computes tokens 10-20 again (a prompt chunk), row 2 decodes its
    # 22nd token: 12 tokens in the graph of 32, 20 of them padding.
    rows, computed, scheduled = np.array([1, 2]), np.array([10, PROMPT_LEN]), np.array([11, 1])
    sample = np.array(needs_sample)
    eager, caches = eager_logits_marking_padding(runner, rows, computed, scheduled, sample)
    graphs = MixedGraphs(runner, 64, 4, capture=False)
    assert graphs.sizes == [32, 64] and graphs.fits(scheduled)
    logits, sampled_rows, positions = graphs.run(rows, computed, scheduled, sample)
    torch.testing.assert_close(logits.float(), eager, atol=1e-4, rtol=1e-4)
    assert sampled_rows.tolist() == rows[sample].tolist()
    assert positions.tolist() == (computed + scheduled)[sample].tolist()
    for cache in caches:
        assert bool((cache[1, 0] == 123.0).all())


@pytest.mark.parametrize(
    ("rows", "computed", "scheduled"),
    [
        ([2, 1], [PROMPT_LEN, 10], [1, 11]),  # a decode, then a chunk
        ([2, 0, 1], [PROMPT_LEN, PROMPT_LEN - 1, 3], [1, 1, 15]),  # two decodes first
        ([2, 0], [PROMPT_LEN, PROMPT_LEN - 1], [1, 1]),  # decodes alone
    ],
)
def test_a_mixed_graph_takes_its_leading_decodes_in_a_launch_of_their_own(
    runner: ModelRunner,
    rows: list[int],
    computed: list[int],
    scheduled: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the Triton backend the graph's decode launch covers its 4 slots
    # (one a layer) and the tiles the rest; on torch's, one launch.
    entries = np.array(rows)
    sample = np.ones(len(rows), bool)
    num_computed, num_scheduled = np.array(computed), np.array(scheduled)
    eager, caches = eager_logits_marking_padding(
        runner, entries, num_computed, num_scheduled, sample
    )
    launches = decode_launches(monkeypatch)
    graphs = MixedGraphs(runner, 64, 4, capture=False)
    logits, _, _ = graphs.run(entries, num_computed, num_scheduled, sample)
    torch.testing.assert_close(logits.float(), eager, atol=1e-4, rtol=1e-4)
    for cache in caches:
        assert bool((cache[1, 0] == 123.0).all())
    layers = runner.spec.num_layers
    assert launches == ([4] * layers if runner.splits_decodes else [])


def test_a_tile_schedule_covers_every_tile_once_the_furthest_reaching_first() -> None:
    schedule = tile_schedule(np.array([0, 40, 5]), np.array([300, 1, 128]), 128, 8)
    assert schedule.tolist() == [[0, 0, 2, 0, 1, -1, -1, -1], [2, 1, 0, 0, 0, -1, -1, -1]]


def test_eager_inputs_gather_whole_table_rows_whatever_the_entries_need(
    runner: ModelRunner,
) -> None:
    """As the decode graphs do: the tables' row stride is then one value,
    and so is the kernels' specialization on it (warm_up.py)."""
    inputs = runner.forward_inputs.prepare(
        np.array([1]), np.array([0]), np.array([5]), np.ones(1, bool)
    )
    (table,) = inputs.metadata.block_tables
    assert table.shape == (1, runner.max_blocks_per_row)  # 5 tokens would need one block
    assert table.tolist() == runner.rows.block_tables[0, 1:2].tolist()
    assert inputs.metadata.slot_mappings[0].tolist() == [
        (1 + BLOCKS_PER_ROW) * runner.config.block_size + i for i in range(5)
    ]
    assert inputs.input_ids.tolist() == runner.rows.token_ids[1, :5].tolist()


def test_a_forward_takes_its_decodes_first_and_answers_in_the_steps_order(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new request's chunk comes first in a step message; the decodes
    # after it move ahead (on the Triton backend, into a launch of their
    # own), and the samples come back in the step's order.
    rows, computed, scheduled = (
        np.array([1, 2, 0]),
        np.array([10, PROMPT_LEN, 20]),
        np.array([11, 1, 1]),
    )
    sample = np.array([True, False, True])
    assert entry_order.decodes_first(scheduled).tolist() == [1, 2, 0]  # type: ignore[union-attr]
    packed = runner.forward_in_order(rows, computed, scheduled, sample)
    launches = decode_launches(monkeypatch)
    moved = runner.forward(rows, computed, scheduled, sample)
    assert packed is not None and moved is not None
    assert moved.token_ids.tolist() == packed.token_ids.tolist()
    torch.testing.assert_close(moved.logprobs, packed.logprobs, atol=1e-4, rtol=1e-4)
    assert launches == ([2] * runner.spec.num_layers if runner.splits_decodes else [])


def test_decodes_first_keeps_each_part_in_order_and_in_step_order_undoes_it() -> None:
    assert entry_order.decodes_first(np.array([1, 1, 5])) is None  # already leading
    assert entry_order.decodes_first(np.array([1, 1])) is None
    assert entry_order.decodes_first(np.array([4, 5])) is None
    order = entry_order.decodes_first(np.array([7, 1, 3, 1]))
    assert order is not None and order.tolist() == [1, 3, 0, 2]
    needs_sample = np.array([True, True, False, True])[order]  # entry 2 samples nothing
    moved = SamplerOutput(  # samples of entries 1, 3, 0, in that order
        torch.tensor([11, 13, 10]),
        torch.tensor([-1.0, -3.0, -0.5]),
        torch.tensor([[11], [13], [10]]),
        torch.tensor([[-1.0], [-3.0], [-0.5]]),
    )
    back = entry_order.in_step_order(moved, order, needs_sample)
    assert back.token_ids.tolist() == [10, 11, 13]
    assert back.logprobs.tolist() == [-0.5, -1.0, -3.0]
    assert back.top_token_ids.tolist() == [[10], [11], [13]]
