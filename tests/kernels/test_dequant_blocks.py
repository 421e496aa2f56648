"""``dequant_blocks``: the blocks a batch reads from an fp8 or int8 cache,
widened into a float buffer, against the formats' own ``dequantize``
gathered through the block table; and the attention over that buffer
against the attention over the quantized cache. On the GPU when there is
one, else under TRITON_INTERPRET=1. (The Gluon prefill's run over such a
buffer, sm_90 only: test_gluon_prefill.py.)"""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import dequant_blocks, fp8_kv, paged_attention, reference
from pagedkv.kernels.kv_quant import scale_args
from tests.kernels.test_fp8_cache_kernels import quantized, scales
from tests.kernels.test_int8_cache_kernels import Int8Cache
from tests.kernels.test_reference import build_batch
from tests.kernels.test_triton_kernels import DEVICE

CONTEXTS, QUERY_LENS = [0, 21, 5], [19, 3, 40]
NAMES = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")


def quantized_batch(
    kind: str, head_size: int = 64
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A mixed batch whose caches are ``kind`` (an fp8 format's name, with
    per-head scales, or int8), and their scales."""
    batch = build_batch(
        CONTEXTS, QUERY_LENS, num_q_heads=4, num_kv_heads=2, head_size=head_size, block_size=8
    )
    if kind == "int8":
        cache = Int8Cache.holding(batch["key_cache"], batch["value_cache"], torch.device("cpu"))  # type: ignore[arg-type]
        batch["key_cache"], batch["value_cache"] = cache.caches
        return batch, cache.scales
    kv = scales(2, per_head=True)
    quantized(batch, fp8_kv.KV_CACHE_DTYPES[kind], kv)
    return batch, kv


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_each_page_a_sequence_reads_is_widened_into_its_own_block(
    kind: str, dtype: torch.dtype
) -> None:
    batch, kv = quantized_batch(kind)
    key_cache, value_cache, block_table, seq_lens = (
        batch[name] for name in ("key_cache", "value_cache", "block_table", "seq_lens")
    )
    assert isinstance(seq_lens, torch.Tensor) and isinstance(block_table, torch.Tensor)
    max_seq_len = int(seq_lens.max())
    on = {name: t.to(DEVICE) for name, t in kv.items()}
    args = scale_args(key_cache.to(DEVICE), on["k_scale"], on["v_scale"], seq_lens.to(DEVICE))  # type: ignore[union-attr]
    keys, values, table = dequant_blocks.dequantize_blocks(
        key_cache.to(DEVICE),  # type: ignore[union-attr]
        value_cache.to(DEVICE),  # type: ignore[union-attr]
        block_table.to(DEVICE),
        seq_lens.to(DEVICE),
        max_seq_len,
        args,
        dtype,
    )
    pages = dequant_blocks.PAGE_MULTIPLE  # 6 pages of 8, rounded up
    assert keys.shape == (len(seq_lens) * pages, 8, 2, 64) and keys.dtype == dtype
    assert keys.is_contiguous() and values.shape == keys.shape
    assert table.tolist() == torch.arange(len(seq_lens) * pages).view(-1, pages).tolist()
    assert dequant_blocks.buffer_bytes(len(seq_lens), max_seq_len, key_cache, dtype) == (  # type: ignore[arg-type]
        2 * keys.numel() * dtype.itemsize
    )
    want_k = reference.from_cache(key_cache, kv["k_scale"], dtype)  # type: ignore[arg-type]
    want_v = reference.from_cache(value_cache, kv["v_scale"], dtype)  # type: ignore[arg-type]
    for seq, seq_len in enumerate(seq_lens.tolist()):
        for pos in range(seq_len):
            block = int(block_table[seq, pos // 8])
            here = (seq * pages + pos // 8, pos % 8)
            assert torch.equal(keys[here].cpu(), want_k[block, pos % 8])
            assert torch.equal(values[here].cpu(), want_v[block, pos % 8])


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_attention_over_the_widened_blocks_is_the_quantized_caches(kind: str) -> None:
    batch, kv = quantized_batch(kind)
    args = [batch[name].to(DEVICE) for name in NAMES]  # type: ignore[union-attr]
    on = {name: t.to(DEVICE) for name, t in kv.items()}
    over_cache = paged_attention.paged_attention(*args, scale=0.3, **on)  # type: ignore[arg-type]
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc = args
    keys, values, table = dequant_blocks.dequantize_blocks(
        key_cache, value_cache, block_table, seq_lens, int(seq_lens.max()),
        scale_args(key_cache, on["k_scale"], on["v_scale"], seq_lens), torch.float32,
    )  # fmt: skip
    widened = paged_attention.paged_attention(
        query, keys, values, table, seq_lens, query_start_loc, scale=0.3
    )
    expected = reference.paged_attention(
        query.cpu(),
        reference.from_cache(batch["key_cache"], kv["k_scale"], torch.float32),  # type: ignore[arg-type]
        reference.from_cache(batch["value_cache"], kv["v_scale"], torch.float32),  # type: ignore[arg-type]
        *[batch[name] for name in NAMES[3:]],  # type: ignore[arg-type]
        scale=0.3,
    )
    torch.testing.assert_close(widened.cpu(), expected, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(widened.cpu(), over_cache.cpu(), atol=2e-3, rtol=2e-3)


def test_a_batch_of_no_sequences_widens_nothing() -> None:
    batch, kv = quantized_batch("fp8_e4m3")
    key_cache = batch["key_cache"].to(DEVICE)  # type: ignore[union-attr]
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    keys, _, table = dequant_blocks.dequantize_blocks(
        key_cache, key_cache, empty.view(0, 1), empty, 0,
        scale_args(key_cache, kv["k_scale"].to(DEVICE), kv["v_scale"].to(DEVICE), empty),
        torch.float16,
    )  # fmt: skip
    assert keys.shape[0] == 0 and table.shape == (0, dequant_blocks.PAGE_MULTIPLE)


def test_one_buffer_a_device_serves_every_call_and_grows_when_a_batch_needs_more() -> None:
    batch, kv = quantized_batch("fp8_e4m3")
    args = [batch[name].to(DEVICE) for name in NAMES]  # type: ignore[union-attr]
    _, key_cache, value_cache, block_table, seq_lens, _ = args
    scale = scale_args(key_cache, kv["k_scale"].to(DEVICE), kv["v_scale"].to(DEVICE), seq_lens)
    base = dequant_blocks.reserve(DEVICE, 1 << 20)
    assert dequant_blocks.reserve(DEVICE, 1000).data_ptr() == base.data_ptr()
    for max_seq_len in (45, 8):  # a batch's, and the first page alone
        keys, values, _ = dequant_blocks.dequantize_blocks(
            key_cache, value_cache, block_table, seq_lens, max_seq_len, scale, torch.float16
        )
        assert keys.data_ptr() == base.data_ptr()
        assert values.data_ptr() == base.data_ptr() + keys.numel() * 2
    grown = dequant_blocks.reserve(DEVICE, 2 << 20)
    assert grown.numel() == 2 << 20
    assert dequant_blocks.reserve(DEVICE, 1 << 20).data_ptr() == grown.data_ptr()


@pytest.mark.parametrize("max_seq_len", [1, 8, 9, 128, 129, 1000])
def test_the_tables_stride_is_a_multiple_of_16_whatever_the_longest_sequence(
    max_seq_len: int,
) -> None:
    # One build of each kernel that reads the table, however long the
    # batch's longest sequence (Triton specializes on divisibility by 16).
    batch, kv = quantized_batch("fp8_e4m3")
    key_cache = batch["key_cache"].to(DEVICE)  # type: ignore[union-attr]
    seq_lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    table = torch.ones(2, 200, dtype=torch.int32, device=DEVICE)
    scale = scale_args(key_cache, kv["k_scale"].to(DEVICE), kv["v_scale"].to(DEVICE), seq_lens)
    _, _, widened = dequant_blocks.dequantize_blocks(
        key_cache, key_cache, table, seq_lens, max_seq_len, scale, torch.float16
    )
    assert widened.stride(0) % 16 == 0 and widened.stride(0) >= -(-max_seq_len // 8)
