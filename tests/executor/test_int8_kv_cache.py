"""An executor whose KV memory holds int8 with a scale per token and KV head
(``--kv-cache-dtype int8``), in one process: nothing to calibrate, its
blocks take ``head_size + 2`` bytes a token and KV head (values, then the
scales in the same allocation), block copies carry the scales, and its
logits stay nearer the float cache's than e4m3's do, with the fused stack
and transformers' modules alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.executor.tiny_model import make_tiny_model
from tests.executor.test_fused_model import make_runner, step_logits


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("int8-kv") / "llama"
    make_tiny_model(path, "llama", seed=3)
    return path


def errors(runner_logits: list[torch.Tensor], exact: list[torch.Tensor]) -> list[float]:
    return [
        float((got - want).norm() / want.norm())
        for got, want in zip(runner_logits, exact, strict=True)
    ]


def test_int8_logits_stay_nearer_the_float_caches_than_fp8s(llama: Path) -> None:
    # Prefill, a mixed step and decodes (test_fused_model.step_logits). The
    # Triton kernels with the fused stack and the torch ones with
    # transformers' modules store the same values but where their rotations
    # round a key apart across a rounding boundary (one int8 step there); the
    # Triton prefill reads tiles dequantized in float16.
    exact = step_logits(make_runner(llama, "torch", fused=False))
    fused = make_runner(llama, "triton", True, kv_cache_dtype="int8")
    modules = make_runner(llama, "torch", False, kv_cache_dtype="int8")
    assert fused.kv.key_caches[0].dtype == torch.int8 and fused.kv.calibrated
    int8_logits = step_logits(fused)
    for got, other in zip(int8_logits, step_logits(modules), strict=True):
        assert float((got - other).norm() / other.norm()) < 0.01
    int8_errors = errors(int8_logits, exact)
    fp8 = make_runner(llama, "triton", True, kv_cache_dtype="fp8_e4m3")
    fp8_errors = errors(step_logits(fp8), exact)
    assert all(0 < e < 0.05 for e in int8_errors), int8_errors
    assert sum(int8_errors) < sum(fp8_errors) / 2, (int8_errors, fp8_errors)


def test_an_int8_block_takes_its_values_byte_and_a_float16_scale_per_token(llama: Path) -> None:
    exact = make_runner(llama, "torch", fused=False)  # float32 on the CPU
    int8 = make_runner(llama, "torch", fused=False, kv_cache_dtype="int8")
    spec = int8.groups[0].spec
    assert [g.spec.dtype for g in int8.groups] == ["int8"] * len(int8.groups)
    per_token_and_head = spec.head_size + 2
    assert exact.bytes_per_block * per_token_and_head == int8.bytes_per_block * 4 * spec.head_size
    kv = int8.kv
    assert kv.num_bytes == kv.num_blocks * int8.bytes_per_block
    assert kv.k_scales is not None and kv.v_scales is not None
    for cache, storage, scales in zip(kv.key_caches, kv.key_storage, kv.k_scales, strict=True):
        assert scales.shape == cache.shape[:3] and scales.dtype == torch.float16
        assert storage.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        assert storage.untyped_storage().data_ptr() == scales.untyped_storage().data_ptr()


def test_a_block_copy_carries_its_scales(llama: Path) -> None:
    runner = make_runner(llama, "triton", True, kv_cache_dtype="int8")
    step_logits(runner)  # writes blocks of both rows
    kv = runner.kv
    assert kv.k_scales is not None and kv.v_scales is not None
    source = int(runner.rows.block_tables[0, 1, 0])
    written = [t[source].clone() for t in (*kv.key_caches, *kv.k_scales, *kv.v_scales)]
    assert all(bool(t.ne(0).any()) for t in written)
    runner.copy_blocks(np.array([[source, 0]], dtype=np.int64))
    copied = [t[0] for t in (*kv.key_caches, *kv.k_scales, *kv.v_scales)]
    assert all(torch.equal(a, b) for a, b in zip(written, copied, strict=True))


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with heads of 32 (a rotation's smallest)."""
    path = tmp_path_factory.mktemp("int8-kv") / "llama-32"
    make_tiny_model(path, "llama", seed=5, head_dim=32)
    return path


def test_int8_blocks_rotate_by_default_where_the_model_allows_it(
    wide_heads: Path, llama: Path
) -> None:
    """In the Hadamard basis a vector's largest magnitude is no longer set
    by a few large channels (docs/memory.md, "int8 blocks"): an int8 memory
    rotates by default, the fused stack and transformers' modules alike,
    and its logits stay near the float cache's, rotated or not."""
    from pagedkv.kernels.fp8_kv import hadamard

    exact = step_logits(make_runner(wide_heads, "torch", False, kv_cache_rotation="none"))
    runs = []
    for backend, fused in (("triton", True), ("torch", False)):
        rotated = make_runner(wide_heads, backend, fused, kv_cache_dtype="int8")
        assert rotated.kv_rotation is not None
        torch.testing.assert_close(rotated.kv_rotation, hadamard(32))
        runs.append(step_logits(rotated))
    plain = make_runner(wide_heads, "triton", True, kv_cache_dtype="int8", kv_cache_rotation="none")
    assert plain.kv_rotation is None
    runs.append(step_logits(plain))
    for logits in runs:
        assert all(e < 0.05 for e in errors(logits, exact)), errors(logits, exact)
    # The Triton prefill reads tiles dequantized in float16, the torch
    # backend in float32: about 0.5% apart here.
    for got, other in zip(runs[0], runs[1], strict=True):
        assert float((got - other).norm() / other.norm()) < 0.01
    # Heads of 16 cannot be rotated: auto leaves them as they are.
    assert make_runner(llama, "torch", False, kv_cache_dtype="int8").kv_rotation is None
