"""The executor bench's step helpers on the CPU (the bench itself needs a
GPU): its decode requests run, and a failed kernel measure is recorded, not
raised."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.bench.executor import bench
from pagedkv.bench.executor.bench_profile import kernel_times
from pagedkv.executor.engine import Executor
from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.runner_config import RunnerConfig
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import executor_pb2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's profiler has no GPU activity")
def test_decode_requests_step_and_a_kernel_measure_without_a_gpu_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tiny_model(tmp_path, "llama", seed=2)
    config = RunnerConfig(
        model=str(tmp_path),
        device="cpu",
        kernel_backend="torch",
        max_num_rows=4,
        max_num_batched_tokens=256,
        num_blocks=64,
    )
    executor = Executor(ModelRunner(config), "tiny")
    executor.reset(executor_pb2.ResetRequest(owner=bench._owner()))
    monkeypatch.setattr(bench, "CONTEXT", 24)
    prompts = np.random.default_rng(0).integers(3, 200, size=(4, 24))
    step_id = bench._prefill(executor, prompts, 1)
    response = executor.step(bench.decode_request(executor, step_id))
    assert list(response.sampled_rows) == [0, 1, 2, 3]
    window = executor.step(bench.decode_request(executor, step_id + 1, num_steps=3))
    assert len(window.sampled_token_ids) == 3 * 4  # three rounds of the four rows
    measured, next_id = kernel_times(executor, step_id + 2, bench.decode_request, steps=2)
    assert measured["steps"] == 2 and "error" in measured
    assert next_id == step_id + 2  # the profiler did not start: no step ran
