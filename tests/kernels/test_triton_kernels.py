"""The Triton kernels against the torch oracles: on the GPU when there is one,
else under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedkv.kernels import cache_ops, decode_attention, paged_attention, reference, slot_mapping
from tests.kernels.test_reference import BLOCK_SIZE, MIXED, build_batch

NAMES = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float32 dots run in tf32 on a GPU.
FP32_TOLERANCE = 1e-4 if DEVICE.type == "cpu" else 5e-3


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(item, device) for item in value]
    return value


def run(kernel: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``kernel`` on DEVICE with CPU arguments: tensors written in place are
    copied back into them, and the result comes back to the CPU."""
    moved = [_to(arg, DEVICE) for arg in args]
    result = kernel(*moved, **{name: _to(value, DEVICE) for name, value in kwargs.items()})
    for arg, on_device in zip(args, moved, strict=True):
        pairs = zip(arg, on_device, strict=True) if isinstance(arg, list) else [(arg, on_device)]
        for cpu, device in pairs:
            if isinstance(cpu, torch.Tensor):
                cpu.copy_(device)
    return _to(result, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads", [4, 1])  # GQA ratios 1 and 4
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
def test_paged_attention_matches_the_oracle(
    dtype: torch.dtype, num_kv_heads: int, sliding_window: int | None, softcap: float | None
) -> None:
    batch = build_batch(*MIXED, num_q_heads=4, num_kv_heads=num_kv_heads, dtype=dtype)
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window, "softcap": softcap}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, **kwargs)
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def tile_schedule(query_lens: list[int], rows: int, extra: int) -> torch.Tensor:
    """Every query tile of every sequence once, and ``extra`` programs with
    none, shuffled: ``paged_attention``'s ``tiles``."""
    pairs = [(seq, t) for seq, q in enumerate(query_lens) for t in range(-(-q // rows))]
    pairs += [(-1, 0)] * extra
    random.Random(0).shuffle(pairs)
    return torch.tensor(pairs, dtype=torch.int32).T.contiguous()


@pytest.mark.parametrize("max_query_len", [24, 2048])  # 16-row tiles, then 128-row ones
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
def test_a_tile_schedule_read_on_the_device_gives_the_same_output(
    max_query_len: int, sliding_window: int | None, softcap: float | None
) -> None:
    # As a CUDA graph launches it: the grid fixed by the schedule's length
    # and a bound on the query lengths; decodes take the prefill kernel too.
    contexts, query_lens = MIXED
    batch = build_batch(contexts, query_lens, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window, "softcap": softcap}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    rows = paged_attention.tile_rows(max_query_len, head_size=args[0].shape[-1])
    tiles = tile_schedule(list(query_lens), rows, extra=5)
    out = run(
        paged_attention.paged_attention, *args, max_query_len=max_query_len, tiles=tiles, **kwargs
    )
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])  # 8, 4 and 1 query heads per KV head
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
def test_decode_entries_beside_a_prefill_read_their_whole_context(
    num_kv_heads: int, sliding_window: int | None, softcap: float | None
) -> None:
    # A decode entry of a mixed batch computes its KV head's query heads in
    # one program: contexts past several whole key tiles (128 keys), and one
    # of exactly a tile, beside a prefill chunk.
    batch = build_batch(
        [300, 5, 200, 127, 0],
        [1, 40, 1, 1, 1],
        num_q_heads=8,
        num_kv_heads=num_kv_heads,
        dtype=torch.float16,
    )
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window, "softcap": softcap}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, **kwargs)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


def test_a_quantized_cache_tiles_the_same_query_rows() -> None:
    # A CUDA graph's tile schedule counts query rows (tile_rows) without
    # knowing the cache's dtype: both tilings must agree on them.
    for tokens in (8, 24, 2048):
        for head_size in (64, 128, 256):
            float_tile = paged_attention.prefill_tiling(tokens, head_size)
            quantized = paged_attention.prefill_tiling(tokens, head_size, quantized=True)
            assert float_tile[0] == quantized[0] == paged_attention.tile_rows(tokens, head_size)
    assert paged_attention.prefill_tiling(2048, 128) == paged_attention.PREFILL_TILE
    assert paged_attention.prefill_tiling(2048, 128, True) == paged_attention.PREFILL_QUANTIZED_TILE


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "read-ahead"])
@pytest.mark.parametrize("fused", [False, True], ids=["", "fused-scale"])
def test_the_prefill_switches_keep_the_output(
    prefetch: bool, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks over cached context and from scratch, many unmasked key tiles
    # each, with the block table read a tile ahead or not and the scale
    # inside exp2 or not (both on by default).
    monkeypatch.setattr(paged_attention, "PREFILL_PREFETCH", prefetch)
    monkeypatch.setattr(paged_attention, "PREFILL_FUSED_SCALE", fused)
    batch = build_batch([300, 0], [40, 150], num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    args = [batch[name] for name in NAMES]
    expected = reference.paged_attention(*args, scale=0.3)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, scale=0.3)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


def test_paged_attention_with_eight_query_heads_per_kv_head_and_head_size_80() -> None:
    batch = build_batch([0, 17], [3, 1], num_q_heads=8, num_kv_heads=1, head_size=80)
    args = [batch[name] for name in NAMES]
    expected = reference.paged_attention(*args, scale=0.1)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, scale=0.1)
    torch.testing.assert_close(out, expected, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)


def test_paged_attention_names_a_bad_argument() -> None:
    batch = build_batch([0], [2], num_q_heads=3, num_kv_heads=2)
    args = [batch[name] for name in NAMES]
    with pytest.raises(ValueError, match="query"):
        run(paged_attention.paged_attention, *args, scale=1.0)


def test_slot_mapping_matches_the_oracle() -> None:
    batch = build_batch(*MIXED, num_q_heads=2, num_kv_heads=2, seed=5)
    starts = batch["query_start_loc"]
    seq_lens = batch["seq_lens"]
    assert isinstance(starts, torch.Tensor) and isinstance(seq_lens, torch.Tensor)
    positions = torch.cat(
        [
            torch.arange(int(n) - int(q), int(n))
            for n, q in zip(seq_lens, starts.diff(), strict=True)
        ]
    )
    block_table = batch["block_table"]
    assert isinstance(block_table, torch.Tensor)
    expected = reference.compute_slot_mapping(starts, positions, block_table, BLOCK_SIZE)
    out = run(slot_mapping.compute_slot_mapping, starts, positions, block_table, BLOCK_SIZE)
    assert torch.equal(out, expected)


def test_reshape_and_cache_matches_the_oracle_and_skips_padding() -> None:
    key_cache = torch.randn(6, BLOCK_SIZE, 2, 64)
    value_cache = torch.randn_like(key_cache)
    key, value = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([17, -1, 3, 95, 40])
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    run(cache_ops.reshape_and_cache, key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_copy_blocks_matches_the_oracle() -> None:
    keys = [torch.randn(5, BLOCK_SIZE, 2, 8) for _ in range(2)]
    values = [torch.randn(5, BLOCK_SIZE, 2, 8) for _ in range(2)]
    expected_keys = [k.clone() for k in keys]
    expected_values = [v.clone() for v in values]
    src_dst = torch.tensor([[1, 4], [2, 3]])
    reference.copy_blocks(expected_keys, expected_values, src_dst)
    run(cache_ops.copy_blocks, keys, values, src_dst)
    for got, want in zip(keys + values, expected_keys + expected_values, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (20, None), (None, 5.0)])
def test_decode_path_matches_the_oracle(
    num_kv_heads: int,
    sliding_window: int | None,
    softcap: float | None,
    prefetch: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Decodes only: contexts at and around block boundaries, a long one split
    # many ways; with the block table read a tile ahead too (DECODE_PREFETCH).
    monkeypatch.setattr(decode_attention, "DECODE_PREFETCH", prefetch)
    batch = build_batch(
        [0, 15, 16, 31, 300], [1, 1, 1, 1, 1], num_q_heads=4, num_kv_heads=num_kv_heads
    )
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window, "softcap": softcap}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, **kwargs)
    torch.testing.assert_close(out, expected, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_decode_path_merges_many_context_splits(
    sliding_window: int | None, prefetch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One long sequence: its context is split across programs; with a window,
    # the splits before the window hold no key and must weigh nothing.
    monkeypatch.setattr(decode_attention, "DECODE_PREFETCH", prefetch)
    batch = build_batch([2000], [1], num_q_heads=2, num_kv_heads=1)
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, **kwargs)
    torch.testing.assert_close(out, expected, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)


@pytest.mark.parametrize("sliding_window", [None, 20])
def test_decode_sized_for_a_longer_bound_gives_the_same_output(sliding_window: int | None) -> None:
    # CUDA graphs launch the decode path sized for max_model_len: every
    # sequence still splits its own context.
    batch = build_batch([0, 15, 16, 31, 300], [1] * 5, num_q_heads=4, num_kv_heads=1)
    args = [batch[name] for name in NAMES]
    kwargs = {"scale": 0.125, "sliding_window": sliding_window}
    expected = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, max_query_len=1, max_seq_len=8192, **kwargs)
    torch.testing.assert_close(out, expected, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)


def test_prefill_with_a_window_far_into_a_long_context() -> None:
    # The tile's first key (rounded down to the key tile) is well past 0.
    batch = build_batch([300, 5], [20, 40], num_q_heads=2, num_kv_heads=1)
    args = [batch[name] for name in NAMES]
    expected = reference.paged_attention(*args, scale=0.125, sliding_window=7)  # type: ignore[arg-type]
    out = run(paged_attention.paged_attention, *args, scale=0.125, sliding_window=7)
    torch.testing.assert_close(out, expected, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)


@pytest.mark.parametrize("num_sms", [8, 132])
def test_decode_splits_fill_one_wave_of_programs(num_sms: int) -> None:
    # Split programs never exceed what the GPU holds at once (a second,
    # partial wave idles most of it), and a long context is split.
    slots = decode_attention.DECODE_PROGRAMS_PER_SM * num_sms
    for pairs in range(1, 3 * slots):
        splits = decode_attention.split_count(pairs, 1 << 20, 64, num_sms)
        assert splits >= 1
        assert pairs * splits <= max(slots, pairs)
        if pairs <= slots // 2 and splits < decode_attention.DECODE_MAX_SPLITS:
            assert pairs * splits > slots // 2


def test_gather_and_scatter_blocks_match_the_oracles() -> None:
    # Four caches (two layers' K and V), separate allocations; blocks in any order.
    caches = [torch.randn(6, BLOCK_SIZE, 2, 8) for _ in range(4)]
    block_ids = torch.tensor([4, 1, 5])
    numel = caches[0][0].numel()
    want = torch.empty(3, 4 * numel)
    reference.gather_blocks(caches, block_ids, want)
    got = torch.zeros_like(want)
    run(cache_ops.gather_blocks, caches, block_ids, got)
    assert torch.equal(got, want)
    rows = torch.randn(3, 4 * numel)
    expected = [c.clone() for c in caches]
    reference.scatter_blocks(expected, block_ids, rows)
    run(cache_ops.scatter_blocks, caches, block_ids, rows)
    for cache, expect in zip(caches, expected, strict=True):
        assert torch.equal(cache, expect)
