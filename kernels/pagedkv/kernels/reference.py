"""Torch oracles of the paged-attention kernels: plain, slow and obviously right.

Every Triton kernel in this package is tested against the function of the same
name here. Layouts (per layer):

- ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]``;
- ``slot = block_id * block_size + offset``; a negative slot means "no slot"
  (padding) and is skipped;
- a batch of sequences is packed: the new (query) tokens of sequence ``i`` are
  rows ``query_start_loc[i] : query_start_loc[i + 1]``;
- ``seq_lens[i]`` counts all of sequence ``i``'s tokens whose K/V are in the
  cache after this step (cached context plus its new tokens), so its queries
  sit at the last positions (bottom-right aligned causal attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.kernels import fp8_kv, int8_kv
from pagedkv.kernels.backend import DecodeInputs


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` (``[..., num_kv_heads, head_size]``) as ``cache`` stores it:
    quantized with ``scale`` for an fp8 cache (``fp8_kv.quantize``), with
    its own scales (``scale``, ``x.shape[:-1]``) for an int8 cache
    (``int8_kv.quantize``), else as it is."""
    if scale is None:
        return x
    if cache.dtype == torch.int8:
        return int8_kv.quantize(x, scale)
    return fp8_kv.quantize(x, scale, cache.dtype)


def from_cache(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """What a kernel reads from a cache (``[..., num_kv_heads, head_size]``),
    in ``dtype``: fp8 values times their ``scale``, int8 values times their
    tokens' scales (``scale``, ``x.shape[:-1]``), else the values."""
    if scale is None:
        return x.to(dtype)
    if x.dtype == torch.int8:
        return int8_kv.dequantize(x, scale, dtype)
    return fp8_kv.dequantize(x, scale, dtype)


def token_scales(
    x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None
) -> torch.Tensor | None:
    """The scales ``x`` is stored with in ``cache``: its own per token and
    KV head for an int8 cache (``int8_kv.token_scales``), else ``scale``."""
    return int8_kv.token_scales(x) if cache.dtype == torch.int8 else scale


def read_scales(
    scale: torch.Tensor | None, cache: torch.Tensor, blocks: torch.Tensor
) -> torch.Tensor | None:
    """What ``from_cache`` multiplies ``cache[blocks]`` by, flattened to its
    tokens: an int8 cache's per-token scales of those blocks (``[n *
    block_size, num_kv_heads]``), else ``scale``."""
    if scale is None or cache.dtype != torch.int8:
        return scale
    return scale[blocks].reshape(-1, cache.shape[2])


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
    """Writes each token's K and V at its slot; negative slots are skipped.
    An fp8 cache stores them quantized with their scales (``to_cache``); an
    int8 cache with each token's own, written into ``k_scale`` and
    ``v_scale`` at its slot (``token_scales``)."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            scales = token_scales(x[token], cache, scale)
            if scales is not scale:
                assert scale is not None and scales is not None
                scale[block, offset] = scales
            cache[block, offset] = to_cache(x[token], cache, scales)


def compute_slot_mapping(
    query_start_loc: torch.Tensor,  # [num_seqs + 1], int
    positions: torch.Tensor,  # [num_tokens], int
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int
    block_size: int,
) -> torch.Tensor:
    """The slot of every packed token: its sequence's block at ``position // block_size``."""
    slots = torch.empty_like(positions, dtype=torch.int64)
    starts = query_start_loc.tolist()
    for seq in range(len(starts) - 1):
        for token in range(starts[seq], starts[seq + 1]):
            position = int(positions[token])
            block = int(block_table[seq, position // block_size])
            slots[token] = block * block_size + position % block_size
    return slots


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
    *,
    k_scale: torch.Tensor | None = None,  # fp8: float32 [1] or [num_kv_heads]; int8: per token
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size], query's dtype
    """Causal attention of each sequence's new tokens over its paged K/V.

    Query token j of a sequence with ``seq_len`` tokens and ``q_len`` new ones
    is at position ``p = seq_len - q_len + j`` and reads keys ``0 .. p``, or
    only ``p - sliding_window + 1 .. p`` with a window. Scores are
    ``scale * q·k``, soft-capped as ``softcap * tanh(score / softcap)`` when
    given. Computed in float32, over what the cache reads as (``from_cache``).
    """
    num_q_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query: {num_q_heads} heads is not a multiple of {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[seq] : starts[seq + 1]].float()  # [q_len, Hq, D]
        q_len = q.shape[0]
        if not q_len:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[seq, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, key_cache.shape[3])
        v = value_cache[blocks].reshape(-1, num_kv_heads, value_cache.shape[3])
        k = from_cache(k, read_scales(k_scale, key_cache, blocks), torch.float32)[:seq_len]
        v = from_cache(v, read_scales(v_scale, value_cache, blocks), torch.float32)[:seq_len]
        k = k.repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = key_pos <= query_pos
        if sliding_window is not None:
            allowed &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[seq] : starts[seq + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def copy_blocks(
    key_caches: Sequence[
        torch.Tensor
    ],  # per layer [num_blocks, block_size, num_kv_heads, head_size]
    value_caches: Sequence[torch.Tensor],  # per layer, same shape
    src_dst: torch.Tensor,  # [num_copies, 2], int: (src block, dst block)
) -> None:
    """Copies block ``src`` into block ``dst`` in every layer, K and V (copy-on-write)."""
    for src, dst in src_dst.tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst] = cache[src]


def gather_blocks(
    caches: Sequence[torch.Tensor],  # each [num_blocks, ...], one shape and dtype
    block_ids: torch.Tensor,  # [n], int
    out: torch.Tensor,  # [n, len(caches) * block_numel], the caches' dtype
) -> None:
    """Row ``i`` of ``out``: block ``block_ids[i]`` of each cache in turn,
    flattened (a host tier's row: layer after layer, K then V)."""
    for i, block in enumerate(block_ids.tolist()):
        out[i] = torch.cat([cache[block].reshape(-1) for cache in caches])


def scatter_blocks(
    caches: Sequence[torch.Tensor],  # each [num_blocks, ...], one shape and dtype
    block_ids: torch.Tensor,  # [n], int, distinct
    rows: torch.Tensor,  # [n, len(caches) * block_numel], the caches' dtype
) -> None:
    """The inverse of ``gather_blocks``: row ``i`` of ``rows`` into block
    ``block_ids[i]`` of each cache. Mutates those blocks only."""
    numel = caches[0][0].numel()
    for i, block in enumerate(block_ids.tolist()):
        for j, cache in enumerate(caches):
            cache[block] = rows[i, j * numel : (j + 1) * numel].view(cache[block].shape)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden_size], x's dtype
    """``weight * rmsnorm(x)`` as Llama's RMSNorm rounds it: the mean of
    squares in float32, the normalised row rounded to ``x``'s dtype, then the
    product with the weight rounded again."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    residual: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum rounded to x's dtype."""
    total = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(total, weight, eps), total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * size] -> [.., size]
    """``silu(gate) * up`` (gate first), the SiLU rounded to the input dtype first."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate).to(gate_up.dtype)
    return (act.float() * up).to(gate_up.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * size] -> [.., size]
    """``gelu(gate, approximate="tanh") * up`` (gate first; Gemma's MLP), as ``silu_mul``."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = torch.nn.functional.gelu(gate, approximate="tanh").to(gate_up.dtype)
    return (act.float() * up).to(gate_up.dtype)


def rotary_embedding(
    x: torch.Tensor,  # [num_tokens, num_heads, head_size]
    cos_sin: torch.Tensor,  # [max_position, head_size]: cos of each pair's angle, then sin
    positions: torch.Tensor,  # [num_tokens], int
    rotate: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size], x's dtype
    """Llama's rotation (dims ``d`` and ``d + head_size / 2`` pair up), in
    float32; with ``rotate``, then times the Hadamard matrix of the head size."""
    half = x.shape[-1] // 2
    angles = cos_sin[positions.long()].float()[:, None, :]  # [T, 1, D]
    cos, sin = angles[..., :half], angles[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if rotate:
        rotated = rotated @ fp8_kv.hadamard(x.shape[-1], x.device)
    return rotated.to(x.dtype)


def rotary_and_cache(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_sin: torch.Tensor,  # [max_position, head_size]
    positions: torch.Tensor,  # [num_tokens], int
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rotate: bool = False,
) -> None:
    """Rotates ``query`` in place; writes the rotated key (rounded to its
    dtype, then quantized for an fp8 cache) and the value at each token's
    slot (negative slots are skipped). With ``rotate`` the rotated query and
    key are then multiplied by the Hadamard matrix of the head size
    (``fp8_kv.hadamard``), in float32, before either is rounded: scores are
    unchanged, and the key is stored in that basis."""
    query.copy_(rotary_embedding(query, cos_sin, positions, rotate))
    rotated = rotary_embedding(key, cos_sin, positions, rotate)
    reshape_and_cache(
        rotated, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )


def rotary_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_size], left unchanged
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
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rotate: bool = False,
) -> torch.Tensor:
    """``rotary_and_cache`` on a copy of the query, then ``paged_attention``
    of one new token per sequence."""
    rotated = query.clone()
    rotary_and_cache(
        rotated,
        key,
        value,
        cos_sin,
        positions,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale=k_scale,
        v_scale=v_scale,
        rotate=rotate,
    )
    query_start_loc = torch.arange(len(query) + 1, dtype=torch.int32, device=query.device)
    return paged_attention(
        rotated,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window=sliding_window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def decode_inputs(
    rows: torch.Tensor,  # int64 [num_entries]
    raw_positions: torch.Tensor,  # int64 [num_entries]: negative for padding
    token_ids: torch.Tensor,  # int64 [max_rows, max_len]
    block_tables: torch.Tensor,  # int32 [num_groups, max_rows, max_columns]
    num_columns: int,
    block_size: int,
) -> DecodeInputs:
    """A decode step's inputs: input ids, clamped positions, int32 sequence
    lengths, each group's gathered tables and slots (-1 for padding)."""
    positions = raw_positions.clamp(min=0)
    tables = block_tables[:, :, :num_columns].index_select(1, rows)
    blocks = tables.gather(2, (positions // block_size)[None, :, None].expand(len(tables), -1, 1))
    slots = blocks[:, :, 0].long() * block_size + positions % block_size
    slots = slots.masked_fill(raw_positions < 0, -1)
    seq_lens = (positions + 1).to(torch.int32)
    return DecodeInputs(token_ids[rows, positions], positions, seq_lens, tables, slots)


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (ties to the lowest id) and its float32 log-probability
    ``max - logsumexp`` of the row, from float32 logits."""
    values = logits.float()
    best, token_ids = values.max(dim=-1)
    return token_ids, best - values.logsumexp(dim=-1)
