"""``pagedkv.bench.kernels.mixed``: its cases' syntax, and that a mixed
batch split in two launches (the decodes, then the chunk) gives what the
packed batch gives and what the oracle gives, over quantized and bf16
blocks (on the CPU, under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.bench.kernels import mixed
from pagedkv.kernels import dequant_blocks, reference


def test_cases_name_a_chunk_and_its_decodes() -> None:
    shapes = mixed.parse_cases("7680x0+15x7936,512x7168+0x1")
    assert shapes[0] == mixed.MixedShape(7680, 0, 15, 7936)
    assert shapes[0].seq_lens == [7936] * 15 + [7680]
    assert shapes[0].num_tokens == 7695
    assert shapes[1].label() == "512x7168+0x1"
    assert len(mixed.parse_cases(mixed.DEFAULT_CASES)) == 7


@pytest.mark.parametrize("text", ["7680x0", "1x0+2x8", "8x0+2", "8x-1+2x8", "ax0+1x1"])
def test_a_bad_case_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="--cases"):
        mixed.parse_cases(text)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_the_split_matches_the_packed_batch(kv: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CPU check; the GPU runs the bench itself")
    dtypes = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
    shape = mixed.MixedShape(new_tokens=20, context=13, decodes=3, decode_len=40)
    batch = mixed.MixedBatch(shape, dtypes[kv], head_size=32, device="cpu", dtype=torch.float16)
    assert batch.rest is not None and batch.rest.query_start_loc.tolist() == [0, 20]
    packed = batch.run()
    torch.testing.assert_close(batch.run(split=True), packed, atol=2e-3, rtol=0)
    key_cache, value_cache, scales = batch.caches
    expected = reference.paged_attention(
        batch.query,
        key_cache,
        value_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        **scales,
    )
    torch.testing.assert_close(packed.float(), expected.float(), atol=2e-3, rtol=0)
    bf16 = reference.paged_attention(
        batch.query, *batch.bf16[:2], batch.block_table, batch.seq_lens,
        batch.query_start_loc, batch.scale,
    )  # fmt: skip
    torch.testing.assert_close(batch.run(quantized=False, split=True), bf16, atol=2e-3, rtol=0)
    # Four sequences, each the longest one's 3 pages rounded up to the buffer's multiple.
    assert batch.buffer()[1] == 4 * dequant_blocks.PAGE_MULTIPLE * 16
    # As a graph's step, over 6 slots (3 of them padding entries), packed and split.
    batch.tiled(slots=6, max_model_len=64)
    assert batch.tiled_decodes.seq_lens.tolist() == [40, 40, 40, 1, 1, 1]
    assert batch.padded_starts.tolist() == [0, 1, 2, 3, 23, 23, 23]
    assert batch.tiles_split[0].tolist().count(3) == batch.tiles[0].tolist().count(3)
    assert {0, 1, 2} <= set(batch.tiles[0].tolist())
    assert set(batch.tiles_split[0].tolist()) == {3, -1}
    for quantized, want in ((True, packed), (False, bf16)):
        tiled = batch.run_tiled(quantized=quantized)
        torch.testing.assert_close(tiled, want, atol=2e-3, rtol=0)
        torch.testing.assert_close(batch.run_tiled(quantized, split=True), tiled, atol=2e-3, rtol=0)
