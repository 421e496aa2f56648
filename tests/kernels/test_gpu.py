"""The kernels on a GPU in bfloat16 at real shapes, against the torch oracles."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import cache_ops, paged_attention, reference, slot_mapping
from tests.kernels.test_reference import build_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NAMES = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")


def on_gpu(batch: dict[str, object]) -> dict[str, object]:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (512, None), (None, 30.0)])
def test_bf16_paged_attention_matches_the_oracle(
    head_size: int, sliding_window: int | None, softcap: float | None
) -> None:
    # Decodes over long contexts, a long prefill, a chunk over cached context.
    batch = on_gpu(
        build_batch(
            [2047, 4095, 0, 1000],
            [1, 1, 700, 300],
            num_q_heads=32,
            num_kv_heads=8,
            dtype=torch.bfloat16,
            head_size=head_size,
        )
    )
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": head_size**-0.5, "sliding_window": sliding_window, "softcap": softcap}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = paged_attention.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_bf16_cache_ops_and_slot_mapping_match_the_oracles() -> None:
    key_cache = torch.randn(64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.randn_like(key_cache)
    key, value = torch.randn(2, 300, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)

    src_dst = torch.tensor([[3, 9], [10, 4]], device="cuda")
    expected = [key_cache.clone()], [value_cache.clone()]
    reference.copy_blocks(*expected, src_dst)
    cache_ops.copy_blocks([key_cache], [value_cache], src_dst)
    assert torch.equal(key_cache, expected[0][0]) and torch.equal(value_cache, expected[1][0])

    starts = torch.tensor([0, 5, 6, 40], device="cuda")
    positions = torch.cat([torch.arange(5), torch.arange(9, 10), torch.arange(100, 134)]).cuda()
    block_table = torch.randperm(63, device="cuda").add(1).view(3, 21).to(torch.int32)
    assert torch.equal(
        slot_mapping.compute_slot_mapping(starts, positions, block_table, 16),
        reference.compute_slot_mapping(starts, positions, block_table, 16),
    )
