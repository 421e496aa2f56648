"""fp8 KV blocks' semantics (pagedkv.kernels.fp8_kv), the contract the cache
kernels will meet: a calibrated scale maps the calibration's largest
magnitude onto the format's largest value, per tensor or per KV head; a
stored value rounds to the format within its precision and reads back in
the compute dtype; anything beyond the calibration saturates instead of
becoming inf or nan."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import fp8_kv

# Relative rounding error of a normal value (half a unit in the last place),
# and the subnormal step (times the scale) below which values lose more.
PRECISION = {torch.float8_e4m3fn: (2.0**-4, 2.0**-9), torch.float8_e5m2: (2.0**-3, 2.0**-16)}


def kv(seed: int = 0, heads: int = 4, head_size: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 40, heads, head_size, generator=generator)
    return x * torch.tensor([1.0, 1e-4, 30.0, 0.5]).view(1, 1, heads, 1)  # heads apart in size


@pytest.mark.parametrize("name", sorted(fp8_kv.KV_CACHE_DTYPES))
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_a_round_trip_keeps_each_value_within_the_formats_precision(
    name: str, per_head: bool
) -> None:
    dtype = fp8_kv.KV_CACHE_DTYPES[name]
    x = kv()
    scale = fp8_kv.calibrated_scale(x, dtype, per_head)
    assert scale.dtype == torch.float32 and scale.shape == ((4,) if per_head else (1,))
    stored = fp8_kv.quantize(x, scale, dtype)
    assert stored.dtype == dtype and stored.shape == x.shape
    # The largest magnitude lands on the format's largest value.
    largest = stored.float().abs().flatten(0, 1).amax(dim=(0, 2))
    assert float(largest.max()) == torch.finfo(dtype).max
    back = fp8_kv.dequantize(stored, scale, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    relative, step = PRECISION[dtype]
    bound = relative * x.abs() + step * scale.view(-1, 1) + 2.0**-8 * x.abs()  # bf16's own
    assert ((back.float() - x).abs() <= bound).all()
    again = fp8_kv.round_trip(x, scale, dtype)
    assert torch.equal(again, fp8_kv.dequantize(stored, scale, x.dtype))


def test_scales_per_head_keep_a_small_heads_values_that_one_scale_flushes() -> None:
    dtype = fp8_kv.KV_CACHE_DTYPES["fp8_e4m3"]
    x = kv()
    error = {}
    for per_head in (False, True):
        back = fp8_kv.round_trip(x, fp8_kv.calibrated_scale(x, dtype, per_head), dtype)
        error[per_head] = ((back - x)[:, :, 1].norm() / x[:, :, 1].norm()).item()
    assert error[True] < 0.1 < error[False]  # head 1 is 300,000 times smaller than head 2


@pytest.mark.parametrize("name", sorted(fp8_kv.KV_CACHE_DTYPES))
def test_a_value_beyond_the_calibration_saturates_and_zeros_give_a_usable_scale(
    name: str,
) -> None:
    dtype = fp8_kv.KV_CACHE_DTYPES[name]
    scale = fp8_kv.calibrated_scale(torch.ones(2, 1, 4), dtype, per_head=False)
    stored = fp8_kv.quantize(torch.tensor([[[1e6, -1e6, 0.5, 1.0]]]), scale, dtype)
    assert stored.float().tolist()[0][0][:2] == [torch.finfo(dtype).max, -torch.finfo(dtype).max]
    assert torch.isfinite(fp8_kv.dequantize(stored, scale, torch.float32)).all()
    zeros = fp8_kv.calibrated_scale(torch.zeros(2, 1, 4), dtype, per_head=True)
    assert (zeros > 0).all()
    assert (fp8_kv.round_trip(torch.zeros(2, 1, 4), zeros, dtype) == 0).all()


def test_headroom_and_rotation_pairs_widen_the_scale_as_a_rotation_can() -> None:
    x = kv()
    dtype = torch.float8_e4m3fn
    plain = fp8_kv.calibrated_scale(x, dtype, per_head=True)
    assert torch.allclose(fp8_kv.calibrated_scale(x, dtype, True, headroom=2.0), 2 * plain)
    # Rotating each pair (d, d + half) by any angle leaves the pairs' scale as
    # it is, and no rotated value exceeds it.
    pairs = fp8_kv.calibrated_scale(x, dtype, True, rotation_pairs=True)
    half = x.shape[-1] // 2
    angle = torch.rand(half) * 6.28
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat(
        [x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1
    )
    torch.testing.assert_close(
        fp8_kv.calibrated_scale(rotated, dtype, True, rotation_pairs=True), pairs
    )
    assert bool((fp8_kv.calibrated_scale(rotated, dtype, True) <= pairs * (1 + 1e-6)).all())
    assert bool((plain <= pairs).all())
