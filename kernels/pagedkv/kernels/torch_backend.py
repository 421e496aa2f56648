"""The paged-attention kernels in batched torch ops: any device, no Triton.

Same names, signatures and contracts as the Triton launchers (``cache_ops``,
``slot_mapping``, ``paged_attention``) and the oracles in ``reference``, with
no Python loop over tokens or sequences. Attention gathers every sequence's
K/V through its block table into a padded ``[num_seqs, max_seq_len, ...]``
tensor and runs one masked attention over the whole batch: query heads that
share a KV head are stacked as rows of that head (GQA without repeating K/V).
fp16/bf16 are computed in float32 on the CPU (its half matmuls are slow and
inexact); results are in the query's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagedkv.kernels import reference
from pagedkv.kernels.backend import DecodeInputs
from pagedkv.kernels.checks import (
    FP8_DTYPES,
    check_attention_args,
    check_block_rows,
    check_block_storage,
    check_cache,
    check_int_vector,
    check_kv_input,
    check_kv_scales,
    check_rotary_args,
    check_rotate,
)
from pagedkv.kernels.decode_split import DecodeSplit, TiledDecodes


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 as its bytes (torch indexes and copies those on every device),
    anything else as it is."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


def _check_block_table(block_table: torch.Tensor, num_seqs: int) -> None:
    if block_table.ndim != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_table: expected an int [num_seqs, max_blocks_per_seq] tensor")
    if block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table: {block_table.shape[0]} rows for {num_seqs} sequences")


def _seq_of_token(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` int64: the sequence each packed token belongs to (no device sync).

    Tokens past ``query_start_loc[-1]`` get ``num_seqs``; callers mask them.
    """
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    ends = query_start_loc[1:].to(torch.int64)
    return torch.searchsorted(ends, tokens, right=True)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int
    *,
    k_scale: torch.Tensor | None = None,  # fp8: float32 [1] or [num_kv_heads]; int8: per token
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes each token's K and V at its slot; negative slots are skipped;
    a quantized cache stores them quantized (``reference.to_cache``), an
    int8 cache's scales written at their slots too.

    Mutates ``key_cache`` and ``value_cache`` at the given slots only. Dropping
    the negative slots is a boolean-mask select: one device sync on a GPU.
    """
    check_cache("key_cache", key_cache)
    check_cache("value_cache", value_cache, like=key_cache)
    if key.ndim != 3 or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key: {tuple(key.shape)} does not match the cache {tuple(key_cache.shape)}"
        )
    check_kv_input("key", key, key_cache)
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError("value: must match key in shape and dtype")
    check_int_vector("slot_mapping", slot_mapping, key.shape[0])
    check_kv_scales(key_cache, k_scale, v_scale)
    if not key.shape[0]:
        return
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.int64)
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        x = x[valid]
        scales = reference.token_scales(x, cache, scale)
        if scales is not scale:  # an int8 cache: each token's scales beside its values
            assert scale is not None and scales is not None
            scale[blocks, offsets] = scales
        _raw(cache)[blocks, offsets] = _raw(reference.to_cache(x, cache, scales))


def compute_slot_mapping(
    query_start_loc: torch.Tensor,  # [num_seqs + 1], int
    positions: torch.Tensor,  # [num_tokens], int
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int
    block_size: int,
    max_query_len: int | None = None,
) -> torch.Tensor:  # [num_tokens], int64
    """The slot of every packed token (int64): its sequence's block at ``position // block_size``.

    ``max_query_len`` is accepted for signature parity and unused: nothing
    here is sized by it, and nothing syncs. Tokens past ``query_start_loc[-1]``
    (batch padding) get slot -1, which ``reshape_and_cache`` skips.
    """
    del max_query_len
    check_int_vector("query_start_loc", query_start_loc)
    check_int_vector("positions", positions)
    num_seqs = len(query_start_loc) - 1
    _check_block_table(block_table, num_seqs)
    num_tokens = len(positions)
    if not num_tokens or num_seqs <= 0:
        return torch.full((num_tokens,), -1, dtype=torch.int64, device=positions.device)
    seqs = _seq_of_token(query_start_loc, num_tokens)
    in_batch = seqs < num_seqs
    positions = positions.to(torch.int64)
    columns = torch.where(in_batch, positions // block_size, 0)
    blocks = block_table[seqs.clamp(max=num_seqs - 1), columns].to(torch.int64)
    slots = blocks * block_size + positions % block_size
    return torch.where(in_batch, slots, -1)


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    key_valid: torch.Tensor,  # [num_seqs, max_seq_len], bool
    dtype: torch.dtype,
    scale: torch.Tensor | None,  # a quantized cache's
) -> torch.Tensor:  # [num_seqs, num_kv_heads, max_seq_len, head_size]
    """Each sequence's K or V in position order, as read (``reference.from_cache``);
    zeros past its ``seq_len``.

    Table entries past a sequence's blocks may be anything: they are clamped
    into range, and what they point at is zeroed (stale or never written
    slots may hold NaN, which a mask alone would let through ``probs @ v``).
    """
    num_seqs, max_seq_len = key_valid.shape
    block_size = cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    blocks = block_table[:num_seqs, :num_blocks].to(torch.int64).clamp(0, cache.shape[0] - 1)
    context = _raw(cache)[blocks].flatten(1, 2)[:, :max_seq_len]  # [S, L, Hkv, D]
    if scale is not None and cache.dtype == torch.int8:  # per token: [S, L, Hkv]
        scale = scale[blocks].flatten(1, 2)[:, :max_seq_len]
    context = reference.from_cache(context.view(cache.dtype), scale, dtype)
    context = torch.where(key_valid[:, :, None, None], context, 0)
    return context.transpose(1, 2)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int
    seq_lens: torch.Tensor,  # [num_seqs], int
    query_start_loc: torch.Tensor,  # [num_seqs + 1], int
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    tiles: torch.Tensor | None = None,  # the Triton kernel's schedule: nothing here
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split: DecodeSplit | TiledDecodes | None = None,  # the Triton path's launches: one here
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size], query's dtype
    """Causal attention of each sequence's new tokens over its paged K/V.

    Same contract as ``reference.paged_attention``. ``max_query_len`` and
    ``max_seq_len`` size the padded batch (upper bounds are fine); each one
    not given costs a device sync. Without ``softcap`` this is one
    ``scaled_dot_product_attention`` call; with it, explicit float32 scores.
    Padding query rows attend to every (zeroed) key so that no row is fully
    masked; their outputs are dropped. Rows of tokens past
    ``query_start_loc[-1]`` are left unspecified, as in the oracle.
    """
    check_attention_args(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        sliding_window,
        softcap,
        scale,
    )
    check_kv_scales(key_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_size = query.shape
    num_seqs, num_kv_heads = len(seq_lens), key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if not num_tokens or not num_seqs:
        return torch.empty_like(query)
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_query_len = max(1, min(max_query_len, num_tokens))
    max_seq_len = max(1, min(max_seq_len, block_table.shape[1] * key_cache.shape[1]))
    device = query.device
    compute_dtype = torch.float32 if device.type == "cpu" else query.dtype

    # Masks: query row j of sequence s sits at position seq_len - q_len + j.
    starts = query_start_loc[:-1].to(torch.int64)[:, None]  # [S, 1]
    query_lens = query_start_loc.diff().to(torch.int64)[:, None]  # [S, 1]
    lens = seq_lens.to(torch.int64)[:, None]  # [S, 1]
    rows = torch.arange(max_query_len, device=device)[None, :]  # [1, Q]
    keys = torch.arange(max_seq_len, device=device)[None, None, :]  # [1, 1, L]
    query_pos = (lens - query_lens + rows)[:, :, None]  # [S, Q, 1]
    allowed = keys <= query_pos
    if sliding_window is not None:
        allowed &= keys > query_pos - sliding_window
    row_valid = (rows < query_lens)[:, :, None]  # [S, Q, 1]
    allowed |= ~row_valid  # padding rows: never fully masked, dropped below
    key_valid = keys[:, 0] < lens  # [S, L]

    # Queries [S, Hkv, group * Q, D]: the query heads sharing a KV head are its rows.
    token_ids = (starts + rows).clamp(max=num_tokens - 1)  # [S, Q]; padding reads any row
    q = query[token_ids].to(compute_dtype)  # [S, Q, Hq, D]
    q = q.view(num_seqs, max_query_len, num_kv_heads, group, head_size)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, -1, head_size)
    k = _gather_context(key_cache, block_table, key_valid, compute_dtype, k_scale)  # [S, Hkv, L, D]
    v = _gather_context(value_cache, block_table, key_valid, compute_dtype, v_scale)
    mask = allowed[:, None, None].expand(-1, -1, group, -1, -1).flatten(2, 3)  # [S, 1, G*Q, L]

    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1), v.float())

    # Back to packed tokens: token t is row t - start of its sequence.
    out = out.reshape(num_seqs, num_kv_heads, group, max_query_len, head_size)
    seqs = _seq_of_token(query_start_loc, num_tokens).clamp(max=num_seqs - 1)
    token_rows = (torch.arange(num_tokens, device=device) - starts[seqs, 0]).clamp(
        0, max_query_len - 1
    )
    packed = out[seqs, :, :, token_rows]  # [T, Hkv, G, D]
    return packed.reshape(num_tokens, num_q_heads, head_size).to(query.dtype)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],  # per layer [num_blocks, block_size, Hkv, D]
    value_caches: Sequence[torch.Tensor],  # per layer, same shape
    src_dst: torch.Tensor,  # [num_copies, 2], int: (src block, dst block)
) -> None:
    """Copies block ``src`` into block ``dst`` in every layer, K and V (copy-on-write):
    each a contiguous ``[num_blocks, ...]`` tensor (``cache_ops.copy_blocks``).

    Mutates the ``dst`` blocks only. All sources are read before any
    destination is written, so a block must not be both a source and a
    destination in one call (the Triton kernel races there, the oracle copies
    in order).
    """
    if (
        src_dst.ndim != 2
        or src_dst.shape[1] != 2
        or src_dst.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"src_dst: expected an int [num_copies, 2] tensor, got {tuple(src_dst.shape)}"
        )
    caches = (*key_caches, *value_caches)
    for i, cache in enumerate(caches):
        check_block_storage(f"caches[{i}]", cache)
    if not len(src_dst):
        return
    for cache in map(_raw, caches):
        pairs = src_dst.to(device=cache.device, dtype=torch.int64)
        cache.index_copy_(0, pairs[:, 1], cache.index_select(0, pairs[:, 0]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)`` per row (the oracle's ops: they are batched)."""
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rmsnorm(x + residual), x + residual)``."""
    return reference.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[num_tokens, 2 * size]`` (gate first)."""
    return reference.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up``, as ``silu_mul``."""
    return reference.gelu_tanh_mul(gate_up)


def rotary_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rotate: bool = False,
) -> None:
    """Rotates ``query`` in place; writes the rotated key and the value at
    each token's slot (negative slots are skipped; an fp8 cache quantized);
    ``rotate`` as the Triton backend's."""
    check_rotary_args(query, key, value, cos_sin, positions, key_cache, value_cache, slot_mapping)
    check_rotate(rotate, query.shape[-1])
    query.copy_(reference.rotary_embedding(query, cos_sin, positions, rotate))
    rotated = reference.rotary_embedding(key, cos_sin, positions, rotate)
    reshape_and_cache(
        rotated, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )


def rotary_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rotate: bool = False,
) -> torch.Tensor:
    """``rotary_and_cache`` on a copy of the query, then ``paged_attention``
    of one new token per sequence (the two ops of this backend)."""
    rotated = query.clone()
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    rotary_and_cache(
        rotated, key, value, cos_sin, positions, key_cache, value_cache, slot_mapping,
        k_scale=k_scale, v_scale=v_scale, rotate=rotate,
    )  # fmt: skip
    query_start_loc = torch.arange(len(query) + 1, dtype=torch.int32, device=query.device)
    return paged_attention(
        rotated,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        softcap,
        max_query_len=1,
        max_seq_len=max_seq_len,
        k_scale=scales["k_scale"],
        v_scale=scales["v_scale"],
    )


def decode_inputs(
    rows: torch.Tensor,
    raw_positions: torch.Tensor,
    token_ids: torch.Tensor,
    block_tables: torch.Tensor,
    num_columns: int,
    block_size: int,
) -> DecodeInputs:
    """A decode step's inputs (the oracle's ops: they are batched)."""
    return reference.decode_inputs(
        rows, raw_positions, token_ids, block_tables, num_columns, block_size
    )


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (ties to the lowest id) and its float32 log-probability."""
    return reference.greedy_sample(logits)


def gather_blocks(
    caches: Sequence[torch.Tensor],  # each [num_blocks, ...], one shape and dtype
    block_ids: torch.Tensor,  # [n], int
    out: torch.Tensor,  # [n, len(caches) * block_numel]
) -> None:
    """See ``reference.gather_blocks``: one ``index_select`` per cache."""
    numel = check_block_rows("out", caches, block_ids, out)
    out = _raw(out)
    for j, cache in enumerate(caches):
        layer = _raw(cache).view(cache.shape[0], -1)
        torch.index_select(layer, 0, block_ids, out=out[:, j * numel : (j + 1) * numel])


def scatter_blocks(
    caches: Sequence[torch.Tensor],  # each [num_blocks, ...], one shape and dtype
    block_ids: torch.Tensor,  # [n], int, distinct
    rows: torch.Tensor,  # [n, len(caches) * block_numel]
) -> None:
    """See ``reference.scatter_blocks``: one ``index_copy_`` per cache."""
    numel = check_block_rows("rows", caches, block_ids, rows)
    rows = _raw(rows)
    for j, cache in enumerate(caches):
        layer = _raw(cache).view(cache.shape[0], -1)
        layer.index_copy_(0, block_ids, rows[:, j * numel : (j + 1) * numel])
