"""The torch oracles agree with plain dense attention on contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.kernels import reference

BLOCK_SIZE = 16
HEAD_SIZE = 64


def build_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head_size: int = HEAD_SIZE,
    block_size: int = BLOCK_SIZE,
) -> dict[str, object]:
    """Random sequences written into a paged cache through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3  # block 0 is the null block
    block_ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for seq, n in enumerate(blocks_per_seq):
        block_table[seq, :n] = torch.tensor([block_ids.pop() for _ in range(n)])
    keys = [torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype) for n in seq_lens]
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    for seq, n in enumerate(seq_lens):
        for pos in range(n):
            block = int(block_table[seq, pos // block_size])
            key_cache[block, pos % block_size] = keys[seq][pos]
            value_cache[block, pos % block_size] = values[seq][pos]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    query = torch.randn(sum(query_lens), num_q_heads, head_size, generator=gen).to(dtype)
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens),
        "query_start_loc": query_start_loc,
        "keys": keys,
        "values": values,
    }


def dense_attention(
    batch: dict[str, object], scale: float, sliding_window: int | None, softcap: float | None
) -> torch.Tensor:
    """Attention on each sequence's contiguous K/V with an explicit mask."""
    query = batch["query"]
    assert isinstance(query, torch.Tensor)
    starts = batch["query_start_loc"].tolist()  # type: ignore[attr-defined]
    out = torch.empty(query.shape, dtype=torch.float32)
    for seq, (k, v) in enumerate(zip(batch["keys"], batch["values"], strict=True)):  # type: ignore[call-overload]
        q = query[starts[seq] : starts[seq + 1]].float().transpose(0, 1)  # [Hq, q, D]
        group = q.shape[0] // k.shape[1]
        k = k.float().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, n, D]
        v = v.float().transpose(0, 1).repeat_interleave(group, 0)
        n, q_len = k.shape[1], q.shape[1]
        rows = torch.arange(n - q_len, n)[:, None]
        cols = torch.arange(n)[None, :]
        mask = cols <= rows
        if sliding_window is not None:
            mask &= cols > rows - sliding_window
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, -math.inf)
        out[starts[seq] : starts[seq + 1]] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def run_oracle(
    batch: dict[str, object], scale: float, sliding_window: int | None, softcap: float | None
) -> torch.Tensor:
    names = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")
    return reference.paged_attention(
        *(batch[name] for name in names),  # type: ignore[arg-type]
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
    )


# (cached context, new tokens) per sequence: decodes, prefills from nothing,
# chunked prefill over cached context, at and around block boundaries.
MIXED = ([0, 0, 0, 15, 16, 17, 40], [1, 16, 17, 1, 1, 9, 24])


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0)])
def test_paged_attention_oracle_matches_dense_attention(
    num_kv_heads: int, sliding_window: int | None, softcap: float | None
) -> None:
    batch = build_batch(*MIXED, num_q_heads=8, num_kv_heads=num_kv_heads)
    scale = HEAD_SIZE**-0.5
    expected = dense_attention(batch, scale, sliding_window, softcap)
    torch.testing.assert_close(run_oracle(batch, scale, sliding_window, softcap), expected)


def test_paged_attention_oracle_keeps_the_query_dtype() -> None:
    batch = build_batch([3], [5], num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    out = run_oracle(batch, 0.125, None, None)
    assert out.dtype == torch.float16
    expected = dense_attention(batch, 0.125, None, None)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


def test_paged_attention_rejects_query_heads_not_a_multiple_of_kv_heads() -> None:
    batch = build_batch([0], [2], num_q_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="query"):
        run_oracle(batch, 1.0, None, None)


def test_slot_mapping_and_reshape_and_cache_rebuild_the_cache() -> None:
    batch = build_batch(*MIXED, num_q_heads=4, num_kv_heads=2, seed=3)
    starts = batch["query_start_loc"]
    seq_lens = batch["seq_lens"].tolist()  # type: ignore[attr-defined]
    positions = torch.cat(
        [
            torch.arange(n - (int(starts[i + 1]) - int(starts[i])), n)  # type: ignore[index]
            for i, n in enumerate(seq_lens)
        ]
    )
    slots = reference.compute_slot_mapping(
        starts,  # type: ignore[arg-type]
        positions,
        batch["block_table"],  # type: ignore[arg-type]
        BLOCK_SIZE,
    )
    key_cache = batch["key_cache"]
    assert isinstance(key_cache, torch.Tensor)
    new_keys = torch.randn(len(slots), key_cache.shape[2], HEAD_SIZE)
    new_values = torch.randn_like(new_keys)
    slots[0] = -1  # a padding token writes nothing
    value_cache = batch["value_cache"]
    assert isinstance(value_cache, torch.Tensor)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, BLOCK_SIZE)
            expected_keys[block, offset] = new_keys[token]
            expected_values[block, offset] = new_values[token]
    reference.reshape_and_cache(new_keys, new_values, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)
    # The slots are where each sequence's table puts each position.
    block_table = batch["block_table"]
    assert isinstance(block_table, torch.Tensor)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), starts.diff())  # type: ignore[union-attr]
    for token in range(1, len(slots)):
        position = int(positions[token])
        block = int(block_table[seq_of_token[token], position // BLOCK_SIZE])
        assert int(slots[token]) == block * BLOCK_SIZE + position % BLOCK_SIZE


def test_copy_blocks_copies_every_layer() -> None:
    layers = [torch.randn(5, BLOCK_SIZE, 2, 8) for _ in range(3)]
    values = [torch.randn(5, BLOCK_SIZE, 2, 8) for _ in range(3)]
    expected = [layer[1].clone() for layer in layers + values]
    reference.copy_blocks(layers, values, torch.tensor([[1, 4]]))
    for layer, block in zip(layers + values, expected, strict=True):
        assert torch.equal(layer[4], block)
