"""The batched torch backend against the torch oracles, and backend selection.

Tolerances: float32 1e-4 (both compute in float32, in a different order);
fp16 1e-3 and bf16 1e-2 (both compute in float32 on the CPU and round once,
so results differ by at most an ulp of the output dtype).
"""

from __future__ import annotations

import sys

import pytest
import torch

import pagedkv.kernels
from pagedkv.kernels import reference, torch_backend
from pagedkv.kernels.backend import BACKEND_NAMES, get_backend
from tests.kernels.test_reference import BLOCK_SIZE, MIXED, build_batch

NAMES = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}


Tensors6 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def attention_args(batch: dict[str, object]) -> Tensors6:
    """The six tensor arguments of ``paged_attention``, in order."""
    query, key_cache, value_cache, block_table, seq_lens, starts = (batch[n] for n in NAMES)
    assert isinstance(query, torch.Tensor) and isinstance(key_cache, torch.Tensor)
    assert isinstance(value_cache, torch.Tensor) and isinstance(block_table, torch.Tensor)
    assert isinstance(seq_lens, torch.Tensor) and isinstance(starts, torch.Tensor)
    return query, key_cache, value_cache, block_table, seq_lens, starts


def assert_matches_oracle(
    batch: dict[str, object],
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Runs both on ``batch``; the real rows must agree and be finite."""
    args = attention_args(batch)
    expected = reference.paged_attention(
        *args, scale=0.125, sliding_window=sliding_window, softcap=softcap
    )
    out = torch_backend.paged_attention(
        *args,
        scale=0.125,
        sliding_window=sliding_window,
        softcap=softcap,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.isfinite(out).all()
    tolerance = TOLERANCE[out.dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    return out


def positions_of(batch: dict[str, object]) -> torch.Tensor:
    """Each new token's position: the last ``q_len`` of its sequence's ``seq_len``."""
    starts, seq_lens = attention_args(batch)[5], attention_args(batch)[4]
    return torch.cat(
        [
            torch.arange(int(n) - int(q), int(n))
            for n, q in zip(seq_lens, starts.diff(), strict=True)
        ]
    )


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize(
    ("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0), (7, 5.0)]
)
def test_mixed_prefill_and_decode_batch_matches_the_oracle(
    num_kv_heads: int, sliding_window: int | None, softcap: float | None
) -> None:
    # MIXED: decodes, prefills from nothing, chunks over cached context, at block boundaries.
    batch = build_batch(*MIXED, num_q_heads=8, num_kv_heads=num_kv_heads)
    assert_matches_oracle(batch, sliding_window, softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, 5.0)])
def test_half_precision_keeps_the_query_dtype(
    dtype: torch.dtype, sliding_window: int | None, softcap: float | None
) -> None:
    batch = build_batch(*MIXED, num_q_heads=8, num_kv_heads=2, dtype=dtype)
    assert_matches_oracle(batch, sliding_window, softcap)


@pytest.mark.parametrize("query_len", [1, 3])
def test_sequence_lengths_around_block_boundaries(query_len: int) -> None:
    seq_lens = [1, 15, 16, 17, 31, 32, 33]
    context_lens = [max(0, n - query_len) for n in seq_lens]
    query_lens = [n - c for n, c in zip(seq_lens, context_lens, strict=True)]
    batch = build_batch(context_lens, query_lens, num_q_heads=4, num_kv_heads=1, seed=1)
    assert_matches_oracle(batch)
    assert_matches_oracle(batch, sliding_window=16)


def test_prefill_from_nothing_at_block_boundaries() -> None:
    batch = build_batch([0] * 5, [1, 15, 16, 17, 33], num_q_heads=4, num_kv_heads=2, seed=2)
    assert_matches_oracle(batch)


def test_chunked_prefill_over_long_cached_context_with_a_window() -> None:
    batch = build_batch([300, 40, 5], [20, 24, 40], num_q_heads=4, num_kv_heads=1, seed=4)
    assert_matches_oracle(batch)
    assert_matches_oracle(batch, sliding_window=7)
    assert_matches_oracle(batch, sliding_window=100, softcap=30.0)


def test_given_bounds_exact_or_loose_give_the_same_result() -> None:
    batch = build_batch(*MIXED, num_q_heads=4, num_kv_heads=2)
    unbounded = assert_matches_oracle(batch)
    exact = assert_matches_oracle(batch, max_query_len=24, max_seq_len=64)
    loose = assert_matches_oracle(batch, max_query_len=100, max_seq_len=10_000)
    assert torch.equal(exact, unbounded) and torch.equal(loose, unbounded)


def test_decode_only_batch_with_bounds() -> None:
    batch = build_batch([0, 15, 16, 31, 300], [1] * 5, num_q_heads=8, num_kv_heads=1)
    assert_matches_oracle(batch, max_query_len=1, max_seq_len=301)
    assert_matches_oracle(batch, sliding_window=20, softcap=5.0)


def test_stale_slots_and_table_tails_do_not_leak_into_real_rows() -> None:
    # Every slot no sequence owns holds NaN, and table entries past a
    # sequence's blocks point anywhere (out of range too): only real keys count.
    batch = build_batch([0, 14, 40], [3, 1, 9], num_q_heads=4, num_kv_heads=2)
    key_cache, value_cache, block_table, seq_lens = attention_args(batch)[1:5]
    owned = torch.zeros(key_cache.shape[:2], dtype=torch.bool)
    for seq, n in enumerate(seq_lens.tolist()):
        for pos in range(n):
            owned[block_table[seq, pos // BLOCK_SIZE], pos % BLOCK_SIZE] = True
        block_table[seq, -(-n // BLOCK_SIZE) :] = 10**6
    key_cache[~owned] = float("nan")
    value_cache[~owned] = float("nan")
    assert_matches_oracle(batch)
    assert_matches_oracle(batch, sliding_window=4, softcap=5.0)


def test_a_sequence_without_new_tokens_is_skipped() -> None:
    batch = build_batch([5, 20, 3], [4, 0, 2], num_q_heads=2, num_kv_heads=1)
    assert_matches_oracle(batch)


def test_empty_batch_gives_an_empty_result() -> None:
    batch = build_batch([3], [2], num_q_heads=2, num_kv_heads=1)
    query, key_cache, value_cache, block_table = attention_args(batch)[:4]
    no_tokens = torch_backend.paged_attention(
        query[:0], key_cache, value_cache, block_table, torch.tensor([3]), torch.tensor([0, 0]), 1.0
    )
    assert no_tokens.shape == (0, 2, 64)
    no_seqs = torch_backend.paged_attention(
        query[:0], key_cache, value_cache, block_table[:0], torch.tensor([]).long(),
        torch.tensor([0]), 1.0,
    )  # fmt: skip
    assert no_seqs.shape == (0, 2, 64)


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"query": torch.randn(2, 3, 64)}, "query"),
        ({"query": torch.randn(2, 2, 32)}, "query"),
        ({"seq_lens": torch.tensor([5.0])}, "seq_lens"),
        ({"query_start_loc": torch.tensor([0, 1, 2])}, "query_start_loc"),
        ({"block_table": torch.zeros(0, 4, dtype=torch.int32)}, "block_table"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"softcap": -1.0}, "softcap"),
        ({"scale": 0.0}, "scale"),
        ({"scale": -0.125}, "scale"),
        ({"scale": float("nan")}, "scale"),
    ],
)
def test_paged_attention_names_a_bad_argument(change: dict[str, object], argument: str) -> None:
    batch = build_batch([3], [2], num_q_heads=2, num_kv_heads=2)
    kwargs: dict[str, object] = {name: batch[name] for name in NAMES}
    kwargs["scale"] = 1.0
    kwargs.update(change)
    with pytest.raises(ValueError, match=argument):
        torch_backend.paged_attention(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_matches_the_oracle_and_skips_padding(dtype: torch.dtype) -> None:
    key_cache = torch.randn(6, BLOCK_SIZE, 2, 64).to(dtype)
    value_cache = torch.randn_like(key_cache)
    key, value = torch.randn(2, 6, 2, 64).to(dtype)
    slots = torch.tensor([17, -1, 3, 95, 40, -7], dtype=torch.int32)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    torch_backend.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_reshape_and_cache_with_no_tokens_or_only_padding_writes_nothing() -> None:
    key_cache = torch.randn(2, BLOCK_SIZE, 1, 8)
    value_cache = torch.randn_like(key_cache)
    before = key_cache.clone(), value_cache.clone()
    empty = torch.empty(0, 1, 8)
    torch_backend.reshape_and_cache(empty, empty, key_cache, value_cache, torch.empty(0).long())
    padding = torch.randn(3, 1, 8)
    torch_backend.reshape_and_cache(padding, padding, key_cache, value_cache, -torch.ones(3).long())
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


def test_reshape_and_cache_names_a_bad_argument() -> None:
    cache = torch.zeros(2, BLOCK_SIZE, 1, 8)
    key = torch.zeros(3, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        torch_backend.reshape_and_cache(key, key, cache, cache, torch.zeros(2).long())
    with pytest.raises(ValueError, match="key"):
        torch_backend.reshape_and_cache(key[:, :, :4], key, cache, cache, torch.zeros(3).long())
    with pytest.raises(ValueError, match="value"):
        torch_backend.reshape_and_cache(key, key.half(), cache, cache, torch.zeros(3).long())


def test_slot_mapping_matches_the_oracle() -> None:
    batch = build_batch(*MIXED, num_q_heads=2, num_kv_heads=2, seed=5)
    starts, block_table = attention_args(batch)[5], attention_args(batch)[3]
    positions = positions_of(batch)
    expected = reference.compute_slot_mapping(starts, positions, block_table, BLOCK_SIZE)
    out = torch_backend.compute_slot_mapping(starts, positions, block_table, BLOCK_SIZE)
    assert out.dtype == torch.int64 and torch.equal(out, expected)
    bounded = torch_backend.compute_slot_mapping(starts, positions, block_table, BLOCK_SIZE, 24)
    assert torch.equal(bounded, expected)


def test_slot_mapping_gives_padding_tokens_past_the_batch_no_slot() -> None:
    block_table = torch.tensor([[7, 2], [5, 0]], dtype=torch.int32)
    starts = torch.tensor([0, 2, 3], dtype=torch.int32)
    positions = torch.tensor([15, 16, 0, 0, 0])  # the last two pad the batch
    out = torch_backend.compute_slot_mapping(starts, positions, block_table, BLOCK_SIZE)
    assert out.tolist() == [7 * 16 + 15, 2 * 16, 5 * 16, -1, -1]
    assert torch_backend.compute_slot_mapping(starts, positions[:0], block_table, 16).numel() == 0


def test_copy_blocks_matches_the_oracle() -> None:
    keys = [torch.randn(5, BLOCK_SIZE, 2, 8) for _ in range(2)]
    values = [torch.randn(5, BLOCK_SIZE, 2, 8).half() for _ in range(2)]
    expected_keys = [k.clone() for k in keys]
    expected_values = [v.clone() for v in values]
    src_dst = torch.tensor([[1, 4], [2, 3], [1, 0]], dtype=torch.int32)
    reference.copy_blocks(expected_keys, expected_values, src_dst)
    torch_backend.copy_blocks(keys, values, src_dst)
    for got, want in zip(keys + values, expected_keys + expected_values, strict=True):
        assert torch.equal(got, want)
    torch_backend.copy_blocks(keys, values, torch.empty(0, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="src_dst"):
        torch_backend.copy_blocks(keys, values, torch.tensor([1, 4]))


def test_slot_mapping_cache_write_and_attention_run_a_step_together() -> None:
    # A chunked-prefill step through the torch backend alone: the new K/V are
    # written at the computed slots, then attended to with the cached context.
    batch = build_batch([17, 0], [5, 16], num_q_heads=4, num_kv_heads=2, seed=6)
    query, key_cache, value_cache, block_table, seq_lens, starts = attention_args(batch)
    expected = reference.paged_attention(*attention_args(batch), scale=0.125)
    new_keys, new_values = key_cache.clone(), value_cache.clone()
    slots = torch_backend.compute_slot_mapping(starts, positions_of(batch), block_table, 16)
    key, value = new_keys.flatten(0, 1)[slots], new_values.flatten(0, 1)[slots]
    key_cache.flatten(0, 1)[slots] = float("nan")  # the step's slots are not written yet
    value_cache.flatten(0, 1)[slots] = float("nan")
    torch_backend.reshape_and_cache(key, value, key_cache, value_cache, slots)
    out = torch_backend.paged_attention(
        query, key_cache, value_cache, block_table, seq_lens, starts, 0.125
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_get_backend_returns_the_named_kernels() -> None:
    assert BACKEND_NAMES == ("triton", "torch")
    backend = get_backend("torch")
    assert backend.name == "torch"
    assert backend.paged_attention is torch_backend.paged_attention
    assert backend.reshape_and_cache is torch_backend.reshape_and_cache
    assert backend.compute_slot_mapping is torch_backend.compute_slot_mapping
    assert backend.copy_blocks is torch_backend.copy_blocks
    triton_backend = get_backend("triton")  # conftest set TRITON_INTERPRET without a GPU
    from pagedkv.kernels import cache_ops, paged_attention, slot_mapping

    assert triton_backend.name == "triton"
    assert triton_backend.paged_attention is paged_attention.paged_attention
    assert triton_backend.reshape_and_cache is cache_ops.reshape_and_cache
    assert triton_backend.compute_slot_mapping is slot_mapping.compute_slot_mapping
    assert triton_backend.copy_blocks is cache_ops.copy_blocks


def test_get_backend_names_the_choices_for_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="'triton', 'torch'"):
        get_backend("cuda")


def test_choosing_torch_needs_no_triton_kernel_module(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing a Triton kernel module now fails: the torch backend must not need one.
    for module in ("cache_ops", "slot_mapping", "paged_attention"):
        monkeypatch.delattr(pagedkv.kernels, module, raising=False)
        monkeypatch.setitem(sys.modules, f"pagedkv.kernels.{module}", None)
    with pytest.raises(ImportError):
        get_backend("triton")
    backend = get_backend("torch")
    batch = build_batch([2], [1], num_q_heads=2, num_kv_heads=1)
    assert backend.paged_attention(*attention_args(batch), scale=1.0).shape == (1, 2, 64)


def test_gather_and_scatter_blocks_match_the_oracles_and_check_their_arguments() -> None:
    caches = [torch.randn(6, 4, 2, 8) for _ in range(4)]
    block_ids = torch.tensor([4, 1, 5])
    numel = caches[0][0].numel()
    want = torch.empty(3, 4 * numel)
    reference.gather_blocks(caches, block_ids, want)
    got = torch.empty_like(want)
    torch_backend.gather_blocks(caches, block_ids, got)
    assert torch.equal(got, want)
    expected = [c.clone() for c in caches]
    rows = torch.randn(3, 4 * numel)
    reference.scatter_blocks(expected, block_ids, rows)
    torch_backend.scatter_blocks(caches, block_ids, rows)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected, strict=True))
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        torch_backend.gather_blocks(caches, block_ids, torch.empty(3, numel))
    with pytest.raises(ValueError, match=r"caches\[1\]: must match"):
        two = torch.empty(3, 2 * numel)
        torch_backend.gather_blocks([caches[0], caches[1][:3]], block_ids, two)
    with pytest.raises(ValueError, match="block_ids"):
        torch_backend.scatter_blocks(caches, block_ids.float(), rows)
