"""An eager step whose decodes come before a prompt's chunk, over a float,
fp8 or int8 memory: its forward inputs describe the rest of the batch
(``DecodeSplit``, every index vector its own), attention takes two
launches, and the logits are those of the same step in one launch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.kernels import paged_attention
from tests.executor.test_fused_model import make_runner
from tests.kernels.test_decode_split import decode_launches

ALL = np.ones(2, bool)
KV_DTYPES = ["auto", "fp8_e4m3", "int8"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("decode-split") / "llama"
    make_tiny_model(path, "llama", seed=4)
    return path


def prefilled(model: Path, backend: str, fused: bool, kv: str) -> ModelRunner:
    """A runner whose row 1 holds a 27-token prompt's K/V."""
    runner = make_runner(model, backend, fused, kv_cache_dtype=kv)
    inputs = runner.forward_inputs.prepare(np.array([1]), np.array([0]), np.array([27]), ALL[:1])
    assert runner.logits(inputs) is not None
    return runner


def mixed_logits(runner: ModelRunner, decodes_first: bool) -> torch.Tensor:
    """Row 1 decodes its 28th token while row 0 prefills 9, in either order;
    the logits in row order (row 0's, then row 1's)."""
    rows, computed, scheduled = np.array([1, 0]), np.array([27, 0]), np.array([1, 9])
    if not decodes_first:
        rows, computed, scheduled = rows[::-1].copy(), computed[::-1].copy(), scheduled[::-1].copy()
    logits = runner.logits(runner.forward_inputs.prepare(rows, computed, scheduled, ALL))
    assert logits is not None
    return logits.flip(0) if decodes_first else logits


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_the_rest_of_the_batch_has_index_vectors_of_its_own(
    llama: Path, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = prefilled(llama, "triton", True, kv)
    prepare = runner.forward_inputs.prepare
    inputs = prepare(np.array([1, 0]), np.array([27, 0]), np.array([1, 9]), ALL)
    splits = inputs.metadata.splits
    assert splits is not None and len(splits) == len(runner.groups)
    split = splits[0]
    assert (split.num_decodes, split.decode_max_seq_len) == (1, 28)
    assert (split.max_query_len, split.max_seq_len) == (9, 9)
    assert split.seq_lens.tolist() == [9] and split.query_start_loc.tolist() == [0, 9]
    assert split.seq_lens.dtype == split.query_start_loc.dtype == torch.int32
    table = runner.rows.block_tables[0]
    assert torch.equal(split.block_table, table[:1])  # row 0's
    for vector in (split.seq_lens, split.query_start_loc, split.block_table):
        assert vector.data_ptr() % 16 == 0  # the kernels' pointer class stays one
    # A prompt first, decodes only, or the switch off when the runner is
    # made: one launch.
    assert (
        prepare(np.array([0, 1]), np.array([0, 27]), np.array([9, 1]), ALL).metadata.splits is None
    )
    assert (
        prepare(np.array([1, 0]), np.array([27, 9]), np.array([1, 1]), ALL).metadata.splits is None
    )
    monkeypatch.setattr(paged_attention, "PREFILL_SPLIT_DECODES", False)
    off = prefilled(llama, "triton", True, kv)
    assert not off.splits_decodes
    off_inputs = off.forward_inputs.prepare(
        np.array([1, 0]), np.array([27, 0]), np.array([1, 9]), ALL
    )
    assert off_inputs.metadata.splits is None


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
def test_two_launches_give_the_logits_of_one(
    llama: Path, kv: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = prefilled(llama, "triton", fused, kv)
    launches = decode_launches(monkeypatch)
    split = mixed_logits(runner, decodes_first=True)
    assert launches == [1] * runner.spec.num_layers  # row 1's decode, alone, in every layer
    # The step again (it writes the same K/V at the same slots), in one launch.
    monkeypatch.setattr(paged_attention, "PREFILL_SPLIT_DECODES", False)
    packed = mixed_logits(runner, decodes_first=True)
    assert launches == [1] * runner.spec.num_layers
    # The decode's attention sums in another order in the decode kernel.
    assert relative(split, packed) < 1e-3
    # The prompt first: one launch whatever the switch says.
    monkeypatch.setattr(paged_attention, "PREFILL_SPLIT_DECODES", True)
    assert relative(mixed_logits(runner, decodes_first=False), packed) < 1e-3
    # The torch backend computes the batch at once: no split is built for it.
    other = prefilled(llama, "torch", fused, kv)
    rows, computed, scheduled = np.array([1, 0]), np.array([27, 0]), np.array([1, 9])
    assert other.forward_inputs.prepare(rows, computed, scheduled, ALL).metadata.splits is None


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())
