"""An executor whose KV memory holds fp8 (``--kv-cache-dtype``), in one
process: its blocks take a quarter of a float32 one's bytes, its scales are
calibrated once at start, the same for every executor of the model, and
its logits stay near the float cache's, with the fused stack and
transformers' modules alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.runner_config import RunnerConfig
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.kernels.fp8_kv import KV_CACHE_DTYPES
from tests.executor.test_fused_model import make_runner, step_logits


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp8-kv") / "llama"
    make_tiny_model(path, "llama", seed=3)
    return path


def fp8_runner(model: Path, backend: str, fused: bool, kv: str = "fp8_e4m3") -> ModelRunner:
    return make_runner(model, backend, fused, kv_cache_dtype=kv)


def test_fp8_logits_stay_near_the_float_caches(llama: Path) -> None:
    # Prefill, a mixed step and decodes (test_fused_model.step_logits); e4m3
    # keeps a mantissa bit more than e5m2, so it errs less. The Triton kernels
    # with the fused stack and the torch ones with transformers' modules store
    # the same bytes but where their rotations round a key apart across an
    # fp8 rounding boundary (a few elements: one fp8 step there).
    exact = step_logits(make_runner(llama, "torch", fused=False))
    errors = {}
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        fused = fp8_runner(llama, "triton", True, kv)
        modules = fp8_runner(llama, "torch", False, kv)
        assert fused.kv.key_caches[0].dtype == KV_CACHE_DTYPES[kv]
        steps = zip(step_logits(fused), step_logits(modules), exact, strict=True)
        for got, other, want in steps:
            assert float((got - other).norm() / want.norm()) < 0.01
            errors.setdefault(kv, []).append(float((got - want).norm() / want.norm()))
    # The tiny random model's logits move by a few percent (its attention is
    # nearly uniform); a trained model's are measured by the accuracy bench.
    assert all(0 < e < 0.15 for e in errors["fp8_e4m3"]), errors
    assert all(0 < e < 0.3 for e in errors["fp8_e5m2"]), errors
    assert sum(errors["fp8_e4m3"]) < sum(errors["fp8_e5m2"])


def test_calibration_gives_every_executor_of_a_model_the_same_scales(llama: Path) -> None:
    fused = fp8_runner(llama, "triton", fused=True)
    modules = fp8_runner(llama, "torch", fused=False)
    kv = fused.kv
    assert kv.calibrated and kv.k_scales is not None and kv.v_scales is not None
    for layer, (k_scale, v_scale) in enumerate(zip(kv.k_scales, kv.v_scales, strict=True)):
        assert k_scale.shape == v_scale.shape == (kv.key_caches[layer].shape[2],)
        assert bool((k_scale > 0).all() and (v_scale > 0).all())
        assert not torch.equal(k_scale, torch.ones_like(k_scale))  # set, not the placeholder
        other = modules.kv
        assert other.k_scales is not None and other.v_scales is not None
        # The fused stack calibrates on keys before the rotation, the modules
        # after it: the pairs' magnitudes are the same (up to the layers'
        # rounding apart, which grows with depth).
        torch.testing.assert_close(other.k_scales[layer], k_scale, rtol=1e-3, atol=0)
        torch.testing.assert_close(other.v_scales[layer], v_scale, rtol=1e-3, atol=0)
    again = fp8_runner(llama, "triton", fused=True).kv  # another executor of the model
    assert again.k_scales is not None and again.v_scales is not None
    mine, theirs = (*kv.k_scales, *kv.v_scales), (*again.k_scales, *again.v_scales)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_an_fp8_block_takes_a_quarter_of_a_float32_ones_bytes(llama: Path) -> None:
    exact = make_runner(llama, "torch", fused=False)
    fp8 = fp8_runner(llama, "torch", fused=False)
    assert exact.bytes_per_block == 4 * fp8.bytes_per_block
    assert [g.spec.dtype for g in fp8.groups] == ["float8_e4m3fn"] * len(fp8.groups)
    assert exact.kv.k_scales is None and exact.kv.v_scales is None and exact.kv.calibrated


def test_kv_cache_dtype_is_checked(llama: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int4' is not one of auto"):
        RunnerConfig(model=str(llama), kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype: float16 differs from the model's"):
        ModelRunner(RunnerConfig(model=str(llama), kv_cache_dtype="float16", num_blocks=8))


def test_scales_a_checkpoint_stores_are_taken_as_they_are(llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tmp_path / "llama"
    shutil.copytree(llama, model)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    stored = {}
    for layer in range(layers):
        stored[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.01 * (layer + 1))
        stored[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.02, 0.03])
    save_file(stored, str(model / "kv_scales.safetensors"))
    runner = fp8_runner(model, "torch", fused=False)
    kv = runner.kv
    assert kv.calibrated and kv.k_scales is not None and kv.v_scales is not None
    for layer in range(layers):
        assert kv.k_scales[layer].tolist() == pytest.approx([0.01 * (layer + 1)] * 2)
        assert kv.v_scales[layer].tolist() == pytest.approx([0.02, 0.03])
    del stored[f"model.layers.{layers - 1}.self_attn.v_scale"]
    save_file(stored, str(model / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match=f"not layers.{layers - 1}.self_attn.v_scale"):
        fp8_runner(model, "torch", fused=False)
    stored[f"model.layers.{layers - 1}.self_attn.v_scale"] = torch.tensor([0.0])
    save_file(stored, str(model / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="is not 1 or 2 positive finite values"):
        fp8_runner(model, "torch", fused=False)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with heads of 32 (a rotation's smallest)."""
    path = tmp_path_factory.mktemp("fp8-kv") / "llama-32"
    make_tiny_model(path, "llama", seed=5, head_dim=32)
    return path


def rotated_runner(model: Path, backend: str, fused: bool, kv: str, rotation: str) -> ModelRunner:
    return make_runner(model, backend, fused, kv_cache_dtype=kv, kv_cache_rotation=rotation)


def test_a_rotated_cache_keeps_the_logits_and_fp8_rotates_by_default(wide_heads: Path) -> None:
    """With K and V in the Hadamard basis (``--kv-cache-rotation
    hadamard``) a float32 cache gives the logits it gives without, in the
    fused stack (the cache write rotates) and in transformers' modules
    alike (the value and output projections carry the rotation); an fp8
    cache rotates by default, with scales from each head's largest norm,
    and its logits stay near the float cache's."""
    from pagedkv.kernels.fp8_kv import hadamard

    exact = step_logits(rotated_runner(wide_heads, "torch", False, "auto", "none"))
    for backend, fused in (("triton", True), ("torch", False)):
        runner = rotated_runner(wide_heads, backend, fused, "auto", "hadamard")
        assert runner.kv_rotation is not None and runner.kv.rotation is not None
        for got, want in zip(step_logits(runner), exact, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    fp8 = rotated_runner(wide_heads, "triton", True, "fp8_e4m3", "auto")
    assert fp8.kv_rotation is not None
    torch.testing.assert_close(fp8.kv_rotation, hadamard(32))
    plain = rotated_runner(wide_heads, "triton", True, "fp8_e4m3", "none")
    assert plain.kv_rotation is None
    for runner in (fp8, plain):
        for got, want in zip(step_logits(runner), exact, strict=True):
            assert float((got - want).norm() / want.norm()) < 0.15


def test_a_rotation_the_model_cannot_take_is_refused_by_name(llama: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_rotation: hadamard needs another model"):
        rotated_runner(llama, "torch", False, "fp8_e4m3", "hadamard")  # heads of 16
    assert rotated_runner(llama, "torch", False, "fp8_e4m3", "auto").kv_rotation is None
    with pytest.raises(ValueError, match="kv_cache_rotation"):
        RunnerConfig(model=str(llama), kv_cache_rotation="givens")
