"""The skinny linear kernel against ``x @ weight.T`` in float32, with
shapes that leave partial tiles along every dim; on the GPU when there is
one, else under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels.skinny_linear import LinearTile, skinny_linear, skinny_linear_partials
from tests.kernels.test_triton_kernels import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(5, 40, 72), (16, 32, 64)])
@pytest.mark.parametrize("split_k", [1, 2, 4])  # 72 features in 32-wide steps: 3 steps
def test_skinny_linear_matches_the_matmul(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int, split_k: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    tile = LinearTile(16, 16, 32, 4, 2, split_k)
    got = skinny_linear(x.to(DEVICE), weight.to(DEVICE), tile)
    want = x.float() @ weight.float().T
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tolerance * 10, rtol=tolerance)


def test_the_partial_sums_add_up_to_the_matmul() -> None:
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(3, 96, generator=gen), torch.randn(20, 96, generator=gen)
    partials = skinny_linear_partials(
        x.to(DEVICE), weight.to(DEVICE), LinearTile(16, 16, 32, 4, 2, 3)
    )
    assert partials.shape == (3, 3, 20) and partials.dtype == torch.float32
    # Split s sums features 32 s .. 32 s + 31.
    want = torch.stack(
        [x[:, 32 * s : 32 * s + 32] @ weight[:, 32 * s : 32 * s + 32].T for s in range(3)]
    )
    torch.testing.assert_close(partials.cpu(), want, atol=1e-4, rtol=1e-4)


def test_skinny_linear_refuses_mismatched_shapes_and_dtypes() -> None:
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="do not match"):
        skinny_linear(x, torch.zeros(16, 4), LinearTile(16, 16, 32))
    with pytest.raises(ValueError, match="one float dtype"):
        skinny_linear(x, torch.zeros(16, 8, dtype=torch.float16), LinearTile(16, 16, 32))
    with pytest.raises(ValueError, match="split_k"):
        skinny_linear(x, torch.zeros(16, 8), LinearTile(16, 16, 32, split_k=0))
