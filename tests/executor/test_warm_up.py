"""The warm-up reaches every kernel variant a step can: each slot-mapping
block and both attention tilings, each sampler path; eager steps meet one
specialization of the kernels' integer and pointer arguments whatever their
lengths; the executor logs its warm-up before it says ready."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.runner_config import RunnerConfig
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.executor.warm_up import (
    SAMPLER_PATHS,
    KernelCompiles,
    WarmUpStep,
    decode_steps,
    slot_mapping_blocks,
    split_steps,
    unwidened_steps,
    warm_up_steps,
)
from pagedkv.kernels import paged_attention
from pagedkv.kernels.decode_attention import launch_constants, sm_count, split_count
from tests.executor.driver import ExecutorProcess
from tests.service.test_model_families import family_dirs

__all__ = ["family_dirs"]  # the session fixture, shared with the stack tests

SMALL_TILE_MAX_QUERY = 16  # paged_attention's small tiles up to this many query tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("warm") / "llama"
    make_tiny_model(path, "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    config = RunnerConfig(
        model=str(model_dir),
        kernel_backend="torch",
        num_blocks=8,
        max_num_rows=4,
        max_num_batched_tokens=64,
    )
    return ModelRunner(config)


def test_the_steps_reach_every_slot_mapping_block_and_both_attention_tilings() -> None:
    steps = warm_up_steps(8192, 2048, 256)
    assert slot_mapping_blocks(steps) == {1 << k for k in range(11)}  # 1 .. 1024
    lengths = {s.num_scheduled for s in steps}
    assert any(1 < n <= SMALL_TILE_MAX_QUERY for n in lengths)
    assert any(n > SMALL_TILE_MAX_QUERY for n in lengths)
    assert steps[0] == WarmUpStep(1, 0, 1)
    assert steps[-1] == WarmUpStep(4, 0, 2048)  # the largest step, as the KV memory was sized


def _split_variant(num_splits: int) -> tuple[bool, bool, int]:
    """What Triton specializes the flash-decoding launch on: the split
    count equal to 1, a multiple of 16, and the merge's power-of-two width."""
    return num_splits == 1, num_splits % 16 == 0, 1 << (num_splits - 1).bit_length()


@pytest.mark.parametrize(
    ("max_model_len", "num_kv_heads", "num_sms"), [(8192, 8, 132), (2048, 2, 8)]
)
@pytest.mark.parametrize(
    ("fp8", "words"), [(False, False), (True, False), (True, True)], ids=["float", "fp8", "words"]
)
def test_decode_steps_reach_each_split_variant_once_at_its_shortest_context(
    max_model_len: int, num_kv_heads: int, num_sms: int, fp8: bool, words: bool
) -> None:
    (block_n, _, _), per_sm = launch_constants(fp8, words)

    def count(pairs: int, seq_len: int) -> int:
        return split_count(pairs, seq_len, block_n, num_sms, per_sm)

    steps = decode_steps(max_model_len, num_kv_heads, num_sms, fp8, words)
    reachable = {  # every decode step: any entries, any contexts
        _split_variant(count(num_seqs * num_kv_heads, seq_len))
        for num_seqs in (1, 2, 3, 64)
        for seq_len in range(1, max_model_len + 1, 7)
    }
    splits = [count(num_kv_heads, s.num_computed + 1) for s in steps]
    assert {_split_variant(n) for n in splits} == reachable
    assert len(steps) == len(reachable)  # each once
    assert all(s.num_seqs == 1 and s.num_scheduled == 1 for s in steps)
    assert all(s.num_computed < max_model_len for s in steps)
    for step, n in zip(steps, splits, strict=True):  # the shortest context with that count
        if step.num_computed:
            assert count(num_kv_heads, step.num_computed) < n


def test_a_largest_step_off_the_powers_of_two_reaches_its_own_block() -> None:
    steps = warm_up_steps(100, 4096, 8)
    assert [s.num_scheduled for s in steps] == [1, 2, 4, 8, 16, 32, 64, 100]
    assert slot_mapping_blocks(steps) == {1, 2, 4, 8, 16, 32, 64, 128}
    steps = warm_up_steps(64, 48, 1)  # the model's length bounds it; one row
    assert steps[-1] == WarmUpStep(1, 0, 48)


@pytest.mark.parametrize(
    ("num_scheduled", "num_computed"),
    [([1], [0]), ([2], [0]), ([16], [0]), ([3, 1], [0, 40]), ([5, 1, 1], [0, 7, 70])],
)
def test_eager_inputs_meet_one_specialization_whatever_the_lengths(
    runner: ModelRunner, num_scheduled: list[int], num_computed: list[int]
) -> None:
    """Triton compiles a kernel per class of its integer arguments (1,
    divisible by 16, other) and per pointer aligned to 16 bytes or not: the
    block tables' row stride and every index vector's alignment are the
    same for any step."""
    rows = np.arange(len(num_scheduled), dtype=np.int64)
    runner.rows.fill_tables(np.ones((len(rows), runner.max_blocks_per_row), np.int64))
    try:
        inputs = runner.forward_inputs.prepare(
            rows, np.array(num_computed), np.array(num_scheduled), np.ones(len(rows), bool)
        )
    finally:
        runner.rows.clear_tables()
    meta = inputs.metadata
    for table in meta.block_tables:
        assert table.stride(0) == runner.max_blocks_per_row
    for tensor in (
        inputs.positions,
        inputs.sample_index,
        inputs.sampled_rows,
        meta.seq_lens,
        meta.query_start_loc,
        *meta.slot_mappings,
    ):
        assert tensor.data_ptr() % 16 == 0


def test_the_warm_up_runs_each_step_and_sampler_path_and_leaves_rows_and_rngs_as_they_were(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int, int]] = []
    forward = runner.forward

    def spy(rows, num_computed, num_scheduled, needs_sample):  # type: ignore[no-untyped-def]
        seen.append((len(rows), int(num_computed.max()), int(num_scheduled.max())))
        return forward(rows, num_computed, num_scheduled, needs_sample)

    monkeypatch.setattr(runner, "forward", spy)
    generator_state = runner.generator.get_state()
    global_state = torch.random.get_rng_state()
    report = runner.warm_up(full=True)

    spec = runner.spec
    expected = decode_steps(spec.max_model_len, spec.num_kv_heads, sm_count(runner.device))
    expected += warm_up_steps(64, spec.max_model_len, 4)
    assert report.steps == expected
    assert seen == [step[:3] for step in expected]
    assert report.sampler_paths == tuple(path.name for path in SAMPLER_PATHS)
    assert report.graph_batch_sizes == ()  # no CUDA graphs on the CPU
    assert not runner.rows.live.any()
    assert not runner.rows.block_tables.any()
    assert torch.equal(runner.generator.get_state(), generator_state)
    assert torch.equal(torch.random.get_rng_state(), global_state)  # the process's RNG too


def test_where_prefills_widen_quantized_blocks_they_run_again_without(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over fp8 or int8 blocks on an sm_90 GPU a prefill widens them for the
    Gluon kernel, unless its buffer would be too large for its new tokens;
    the warm-up's prefills have no context beside them, so each the Gluon
    kernel takes widens, and the prefills run once more with the widening
    off, which builds the Triton kernel the other steps take."""

    seen: list[tuple[int, bool]] = []
    forward = runner.forward

    def spy(rows, num_computed, num_scheduled, needs_sample):  # type: ignore[no-untyped-def]
        seen.append((int(num_scheduled.max()), paged_attention.PREFILL_DEQUANTIZE))
        return forward(rows, num_computed, num_scheduled, needs_sample)

    monkeypatch.setattr(runner, "forward", spy)
    monkeypatch.setattr(ModelRunner, "widens_prefill_blocks", property(lambda self: True))
    report = runner.warm_up(full=True)
    spec = runner.spec
    steps = decode_steps(spec.max_model_len, spec.num_kv_heads, sm_count(runner.device))
    steps += warm_up_steps(64, spec.max_model_len, 4)
    again = warm_up_steps(64, spec.max_model_len, 4)[1:]  # all but its decode
    assert unwidened_steps(steps) == again
    assert report.steps == steps + again
    assert seen == [(step.num_scheduled, True) for step in steps] + [
        (step.num_scheduled, False) for step in again
    ]
    assert paged_attention.PREFILL_DEQUANTIZE  # on again after


def test_over_quantized_blocks_each_decode_runs_again_before_a_prompt(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over fp8 or int8 blocks, a step whose decodes come before a prompt
    launches the decode kernel over them alone, without the rotary
    embedding a fused model's decode steps fold into it: each decode
    variant runs once more before a two-token prompt, attended in two
    launches."""
    config = RunnerConfig(
        model=str(model_dir),
        kernel_backend="triton",
        num_blocks=8,
        max_num_rows=4,
        max_num_batched_tokens=64,
        kv_cache_dtype="fp8_e4m3",
    )
    runner = ModelRunner(config)
    seen: list[tuple[list[int], list[int], bool]] = []
    prepare = runner.forward_inputs.prepare

    def spy(rows, num_computed, num_scheduled, needs_sample):  # type: ignore[no-untyped-def]
        inputs = prepare(rows, num_computed, num_scheduled, needs_sample)
        split = inputs.metadata.splits is not None
        seen.append((num_computed.tolist(), num_scheduled.tolist(), split))
        return inputs

    monkeypatch.setattr(runner.forward_inputs, "prepare", spy)
    report = runner.warm_up(full=True)

    spec = runner.spec
    decodes = decode_steps(spec.max_model_len, spec.num_kv_heads, sm_count(runner.device), True)
    assert decodes and report.steps[-len(decodes) :] == split_steps(decodes)
    assert seen[-len(decodes) :] == [([d.num_computed, 0], [1, 2], True) for d in decodes]
    assert not any(split for *_, split in seen[: -len(decodes)])
    assert not runner.rows.live.any() and not runner.rows.block_tables.any()


def test_on_the_cpu_the_warm_up_only_logs(runner: ModelRunner) -> None:
    report = runner.warm_up()
    assert report.steps == () and report.sampler_paths == ()


def test_the_executor_logs_its_warm_up_before_it_says_ready(model_dir: Path) -> None:
    with ExecutorProcess(model_dir, num_blocks=16) as process:
        log = process.stderr()
    assert "executor warmed up" in log
    line = next(line for line in log.splitlines() if "executor warmed up" in line)
    assert "seconds=" in line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype"),
    [("llama", "auto"), ("gemma2", "auto"), ("llama-64", "fp8_e4m3"), ("llama-64", "int8")],
)
def test_after_the_warm_up_mixed_eager_steps_compile_nothing(
    model_dir: Path,
    family_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    arch: str,
    kv_cache_dtype: str,
) -> None:
    """Steps of the shapes a scheduler sends after ready (prefill chunks of
    any length beside decodes, before or after them, at any context, one to
    four entries), and
    eager decodes (one-token entries, sampled or not, split by their
    context), reach only kernel variants the warm-up built. ``llama-64``:
    head size 64 in bfloat16, which the Gluon prefill takes, over fp8 and
    int8 blocks (widened for it, or read by the Triton kernel where the
    widening would be too large for the new tokens)."""
    dtype = "auto"
    if arch == "llama":
        path = model_dir
    elif arch == "llama-64":
        path, dtype = tmp_path_factory.mktemp("head64") / "llama", "bfloat16"
        make_tiny_model(path, "llama", seed=3, head_dim=64)
    else:
        path = family_dirs[arch]
    config = RunnerConfig(
        model=str(path),
        device="cuda",
        dtype=dtype,
        kernel_backend="triton",
        num_blocks=64,
        max_num_rows=4,
        max_num_batched_tokens=64,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(config)
    runner.warm_up()
    compiles = KernelCompiles.install()
    if not compiles.available:
        pytest.skip("this Triton has no post-compile hook")
    before = compiles.count
    steps = [  # (num_scheduled, num_computed, needs_sample) of each entry
        ([1], [0], [True]),
        ([3], [0], [True]),
        ([17, 1], [0, 40], [False, True]),
        ([5, 1, 1], [0, 7, 70], [True, True, True]),
        ([29, 2, 16, 1], [3, 0, 48, 100], [False, True, True, True]),
        ([64], [0], [True]),
        ([1, 1], [300, 900], [True, False]),  # eager decodes: split counts by context
        ([1], [1000], [True]),
        ([1, 1, 1, 1], [1000, 5, 9, 700], [True, True, False, True]),
        ([1], [40], [False]),
        # Decodes before prompts: over fp8 and int8 blocks, two launches.
        ([1, 17], [40, 0], [True, False]),
        ([1, 1, 5], [70, 900, 7], [True, False, True]),
        ([1, 29, 1, 2], [1000, 3, 5, 0], [True, True, True, True]),
    ]
    for num_scheduled, num_computed, needs_sample in steps:
        rows = np.arange(len(num_scheduled), dtype=np.int64)
        runner.rows.fill_tables(np.ones((len(rows), runner.max_blocks_per_row), np.int64))
        runner.forward(
            rows, np.array(num_computed), np.array(num_scheduled), np.array(needs_sample)
        )
        runner.rows.free(rows.tolist())
        runner.rows.clear_tables()
    torch.cuda.synchronize()
    assert compiles.count == before


def test_importing_the_runner_defines_no_kernel() -> None:
    """The executor's modules import the kernel modules only when a backend
    is chosen, so Triton's interpreter can still be chosen after them."""
    code = (
        "import sys, pagedkv.executor.model_runner, pagedkv.executor.warm_up\n"
        "print(' '.join(m for m in sys.modules if m.startswith('pagedkv.kernels.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    loaded = set(result.stdout.split())
    assert "pagedkv.kernels.backend" in loaded
    assert not loaded & {"pagedkv.kernels.decode_attention", "pagedkv.kernels.paged_attention"}


def test_the_pools_sizing_leaves_room_for_every_graphs_logits() -> None:
    """``graph_logits_bytes``: a decode graph per batch size keeps
    ``[batch, vocab]`` logits, a mixed graph per token count ``[entries,
    vocab]`` (at most a row per entry); on the GPU the test of the measured
    pool checks it against the captured graphs."""
    from pagedkv.executor.model_runner import graph_logits_bytes
    from pagedkv.executor.runner_config import RunnerConfig

    config = RunnerConfig(model="m", max_num_rows=256, max_num_batched_tokens=2048)
    decode_rows = 1 + 2 + 4 + 8 + 16 + 24 + 32 + 48 + 64 + 96 + 128 + 160 + 192 + 224 + 256
    mixed_rows = 32 + 64 + 96 + 128 + 192 + 256 * 7  # token counts 32 .. 1,024, entries <= 256
    want = (decode_rows + mixed_rows) * 1000 * 2
    assert graph_logits_bytes(config, 1000, torch.bfloat16) == want
    eager_mixed = RunnerConfig(
        model="m", max_num_rows=4, max_num_batched_tokens=64, mixed_graphs=False
    )
    assert graph_logits_bytes(eager_mixed, 10, torch.float32) == (1 + 2 + 4) * 10 * 4
