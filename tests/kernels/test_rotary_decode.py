"""``rotary_decode_attention`` (the flash-decoding kernel rotating the query
and writing the new keys and values itself) against its oracle:
``rotary_and_cache`` on a copy of the query, then ``paged_attention``; both
backends; on the GPU when there is one, else under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import decode_attention, paged_attention, reference, torch_backend
from tests.kernels.test_fused_ops import llama_cos_sin
from tests.kernels.test_reference import BLOCK_SIZE, HEAD_SIZE, build_batch
from tests.kernels.test_triton_kernels import DEVICE, FP32_TOLERANCE


def decode_case(
    context_lens: list[int],
    num_kv_heads: int,
    dtype: torch.dtype,
    pad_last: bool = False,
    num_q_heads: int = 4,
    head_size: int = HEAD_SIZE,
    block_size: int = BLOCK_SIZE,
) -> dict[str, torch.Tensor]:
    """A batch of one-token decodes whose new keys and values are given
    apart (the cache holds stale values at their slots)."""
    batch = build_batch(
        context_lens,
        [1] * len(context_lens),
        num_q_heads,
        num_kv_heads,
        dtype=dtype,
        head_size=head_size,
        block_size=block_size,
    )
    gen = torch.Generator().manual_seed(5)
    seq_lens = batch["seq_lens"]
    assert isinstance(seq_lens, torch.Tensor)
    positions = seq_lens - 1
    table = batch["block_table"]
    assert isinstance(table, torch.Tensor)
    blocks = table[torch.arange(len(positions)), positions // block_size].long()
    slots = blocks * block_size + positions % block_size
    if pad_last:  # as a CUDA graph's padding row: no slot
        slots[-1] = -1
    shape = (len(positions), num_kv_heads, head_size)
    return {
        "query": batch["query"],  # type: ignore[dict-item]
        "key": torch.randn(shape, generator=gen).to(dtype),
        "value": torch.randn(shape, generator=gen).to(dtype),
        "cos_sin": llama_cos_sin(max(context_lens) + 8, head_size).to(dtype),
        "positions": positions,
        "key_cache": batch["key_cache"],  # type: ignore[dict-item]
        "value_cache": batch["value_cache"],  # type: ignore[dict-item]
        "slot_mapping": slots,
        "block_table": table,
        "seq_lens": seq_lens,
    }


def check(
    case: dict[str, torch.Tensor],
    dtype: torch.dtype,
    max_seq_len: int | None = None,
    **kwargs: object,
) -> None:
    want_caches = [case["key_cache"].clone(), case["value_cache"].clone()]
    args = dict(case, key_cache=want_caches[0], value_cache=want_caches[1])
    want = reference.rotary_decode_attention(**args, scale=0.125, **kwargs)  # type: ignore[arg-type]
    kwargs["max_seq_len"] = max_seq_len
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else 2e-3
    for module in (paged_attention, torch_backend):
        on_device = {name: t.to(DEVICE) for name, t in case.items()}
        query = on_device["query"].clone()
        got = module.rotary_decode_attention(**on_device, scale=0.125, **kwargs)  # type: ignore[arg-type]
        torch.testing.assert_close(got.cpu(), want, atol=tolerance, rtol=tolerance)
        assert torch.equal(on_device["query"], query)  # the query is left as it was
        for name, cache in zip(("key_cache", "value_cache"), want_caches, strict=True):
            torch.testing.assert_close(on_device[name].cpu(), cache, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (20, None), (None, 5.0)])
def test_rotary_decode_attention_matches_the_oracle(
    dtype: torch.dtype, num_kv_heads: int, sliding_window: int | None, softcap: float | None
) -> None:
    # Contexts at and around block boundaries, a long one; the last row pads.
    case = decode_case([0, 15, 16, 31, 300, 7], num_kv_heads, dtype, pad_last=True)
    check(case, dtype, sliding_window=sliding_window, softcap=softcap)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_the_split_that_holds_the_new_token_writes_it(
    sliding_window: int | None, prefetch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One long context split across programs, launched for a longer bound
    # (as CUDA graphs launch it): only the last split writes, before it
    # reads (the block table read a tile ahead too: DECODE_PREFETCH).
    monkeypatch.setattr(decode_attention, "DECODE_PREFETCH", prefetch)
    case = decode_case([2000], 1, torch.float32)
    check(case, torch.float32, sliding_window=sliding_window, max_seq_len=8192)
    check(decode_case([0, 15, 16, 31, 300, 7], 2, torch.float16, pad_last=True), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_size", [32, 64])
def test_rotate_writes_and_attends_in_the_hadamard_basis(
    dtype: torch.dtype, head_size: int
) -> None:
    # rotary_and_cache's rotate in the same launch: the query and the new key
    # times the Hadamard matrix; one context split across programs too.
    case = decode_case([0, 15, 16, 31, 300, 7], 2, dtype, pad_last=True, head_size=head_size)
    check(case, dtype, rotate=True)
    check(decode_case([2000], 1, dtype, head_size=head_size), dtype, rotate=True, max_seq_len=8192)


def test_rotate_needs_a_head_size_that_is_a_power_of_two() -> None:
    case = decode_case([5], 1, torch.float32, head_size=48)
    with pytest.raises(ValueError, match="rotate: needs a head size"):
        paged_attention.rotary_decode_attention(**case, scale=0.125, rotate=True)  # type: ignore[arg-type]
