"""The kernels at block sizes 8 and 32 (the executor's ``--block-size``;
the other kernel tests use 16) against the torch oracles, which the dense
check below holds at the same sizes: the paged layout (``position //
block_size``, ``position % block_size``) and the attention kernels' key
loop, whose key tile (16) is then larger or smaller than a block. On the
GPU when there is one, else under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import cache_ops, paged_attention, reference, slot_mapping
from tests.kernels.test_reference import MIXED, build_batch, dense_attention, run_oracle
from tests.kernels.test_rotary_decode import check, decode_case
from tests.kernels.test_triton_kernels import FP32_TOLERANCE, NAMES, run

BLOCK_SIZES = [8, 32]
DTYPES = [torch.float32, torch.float16]


def tolerance(dtype: torch.dtype) -> float:
    return FP32_TOLERANCE if dtype == torch.float32 else 2e-3


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
def test_the_oracle_matches_dense_attention(
    block_size: int, sliding_window: int | None, softcap: float | None
) -> None:
    batch = build_batch(*MIXED, num_q_heads=4, num_kv_heads=2, block_size=block_size)
    expected = dense_attention(batch, 0.125, sliding_window, softcap)
    torch.testing.assert_close(run_oracle(batch, 0.125, sliding_window, softcap), expected)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
def test_paged_attention_matches_the_oracle(
    block_size: int, dtype: torch.dtype, sliding_window: int | None, softcap: float | None
) -> None:
    # Prefills, chunks over cached context and decodes, around block boundaries.
    batch = build_batch(*MIXED, num_q_heads=4, num_kv_heads=2, dtype=dtype, block_size=block_size)
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window, "softcap": softcap}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, **kwargs)
    torch.testing.assert_close(out, expected, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_the_decode_path_matches_the_oracle(
    block_size: int, dtype: torch.dtype, sliding_window: int | None
) -> None:
    # Decodes only (the flash-decoding kernel): contexts at and around both
    # block sizes' boundaries, and one long enough to be split.
    batch = build_batch(
        [0, 7, 8, 31, 32, 300], [1] * 6, num_q_heads=4, num_kv_heads=1, dtype=dtype,
        block_size=block_size,
    )  # fmt: skip
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, max_query_len=1, max_seq_len=512, **kwargs)
    torch.testing.assert_close(out, expected, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_decode_attention_matches_the_oracle(block_size: int, dtype: torch.dtype) -> None:
    # The new token's key and value land in their block at their offset; the last row pads.
    case = decode_case([0, 7, 8, 31, 32, 300, 5], 2, dtype, pad_last=True, block_size=block_size)
    check(case, dtype, sliding_window=20)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_slot_mapping_and_reshape_and_cache_match_the_oracles(block_size: int) -> None:
    batch = build_batch(*MIXED, num_q_heads=2, num_kv_heads=2, seed=5, block_size=block_size)
    starts, seq_lens, block_table = (
        batch[name] for name in ("query_start_loc", "seq_lens", "block_table")
    )
    assert isinstance(starts, torch.Tensor) and isinstance(seq_lens, torch.Tensor)
    positions = torch.cat(
        [
            torch.arange(int(n) - int(q), int(n))
            for n, q in zip(seq_lens, starts.diff(), strict=True)
        ]
    )
    expected = reference.compute_slot_mapping(starts, positions, block_table, block_size)  # type: ignore[arg-type]
    slots = run(slot_mapping.compute_slot_mapping, starts, positions, block_table, block_size)
    assert torch.equal(slots, expected)

    key_cache, value_cache = batch["key_cache"], batch["value_cache"]
    assert isinstance(key_cache, torch.Tensor) and isinstance(value_cache, torch.Tensor)
    key, value = torch.randn(len(slots), 2, 64), torch.randn(len(slots), 2, 64)
    slots[3] = -1  # a padding token writes nothing
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    run(cache_ops.reshape_and_cache, key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
