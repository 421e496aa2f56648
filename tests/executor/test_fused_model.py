"""The fused decoder stack against transformers' modules on the same weights,
in one process: a prefill, then a step mixing a prefill chunk and a decode
over cached context, logits compared at every sampled token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.executor.fused_support import unsupported_reason
from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.runner_config import RunnerConfig
from pagedkv.executor.tiny_model import make_tiny_model, tiny_config

BLOCKS_PER_ROW = 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused-models")
    dirs = {}
    for arch in ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3"):
        dirs[arch] = root / arch
        make_tiny_model(dirs[arch], arch, seed=3)
    return dirs


def make_runner(
    model_dir: Path,
    backend: str,
    fused: bool,
    device: str = "cpu",
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    kv_cache_rotation: str = "auto",
) -> ModelRunner:
    config = RunnerConfig(
        model=str(model_dir),
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_rotation=kv_cache_rotation,
        kernel_backend=backend,
        num_blocks=1 + 2 * BLOCKS_PER_ROW,
        max_num_rows=2,
        max_num_batched_tokens=64,
        fused_ops=fused,
    )
    runner = ModelRunner(config)
    # Row r holds blocks 1 + 4r .. 4 + 4r in every group.
    runner.rows.fill_tables(1 + np.arange(2 * BLOCKS_PER_ROW).reshape(2, BLOCKS_PER_ROW))
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 30))
    rows = np.repeat([0, 1], 30)
    runner.rows.write_tokens(rows, np.tile(np.arange(30), 2), tokens.reshape(-1))
    return runner


def step_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Row 1 prefills 27 tokens (a window of 24 in mistral); then row 0
    prefills 9 while row 1 decodes its 28th; then both decode (a batch of
    decodes only: the fused stack's one-launch rotary and attention)."""
    rows = np.array([0, 1])
    steps = [
        (np.array([1]), np.array([0]), np.array([27])),
        (rows, np.array([0, 27]), np.array([9, 1])),
        (rows, np.array([9, 28]), np.array([1, 1])),
    ]
    logits = []
    for step_rows, computed, scheduled in steps:
        inputs = runner.forward_inputs.prepare(
            step_rows, computed, scheduled, np.ones(len(step_rows), bool)
        )
        out = runner.logits(inputs)
        assert out is not None
        logits.append(out)
    return logits


@pytest.mark.parametrize(
    ("arch", "backend"),
    [
        ("llama", "torch"),
        ("qwen2", "torch"),
        ("mistral", "triton"),
        ("qwen3", "triton"),  # query and key norms
        ("phi3", "torch"),  # merged projections, read as they are
        # Sandwich norms of 1 + w, GELU, a window layer and a full one;
        # gemma2: soft-capped attention and logits; gemma3: query/key norms
        # and a rotary per layer type.
        ("gemma2", "triton"),
        ("gemma3", "torch"),
    ],
)
def test_fused_logits_match_transformers_modules(
    model_dirs: dict[str, Path], arch: str, backend: str
) -> None:
    fused = make_runner(model_dirs[arch], backend, fused=True)
    unfused = make_runner(model_dirs[arch], backend, fused=False)
    assert fused.fused is not None and unfused.fused is None
    expected = step_logits(unfused)
    for got, want in zip(step_logits(fused), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The modules' weights became views of the merged ones: unfused, the
    # same model still gives transformers' logits.
    fused.fused = None
    for got, want in zip(step_logits(fused), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_models_of_other_shapes_keep_transformers_modules() -> None:
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.hidden_act = "gelu"
    model = AutoModelForCausalLM.from_config(config)
    assert (
        unsupported_reason(model) == "activation 'gelu' is not one of ('silu', 'gelu_pytorch_tanh')"
    )
    model.config.hidden_act = "silu"
    assert unsupported_reason(model) is None
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert "depends on the sequence length" in (unsupported_reason(model) or "")
    # phi3 may rotate a part of each head only.
    phi3 = AutoModelForCausalLM.from_config(tiny_config("phi3"))
    assert unsupported_reason(phi3) is None
    phi3.config.rope_parameters = {**phi3.config.rope_parameters, "partial_rotary_factor": 0.5}
    assert "rotates part of each head" in (unsupported_reason(phi3) or "")
    # Query and key norms are qwen3's and gemma3's only.
    llama = AutoModelForCausalLM.from_config(tiny_config("llama"))
    llama.model.layers[1].self_attn.q_norm = torch.nn.Identity()
    assert "normalises queries or keys" in (unsupported_reason(llama) or "")
    # A gemma3 rotary per layer type, each checked.
    gemma3 = AutoModelForCausalLM.from_config(tiny_config("gemma3"))
    assert unsupported_reason(gemma3) is None
    gemma3.config.rope_parameters["full_attention"]["rope_type"] = "dynamic"
    assert "depends on the sequence length" in (unsupported_reason(gemma3) or "")
