"""Argument checks shared by the kernel launchers: clear errors naming the argument."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Caches whose values are quantized: fp8 (scales per tensor or KV head) and
# int8 (a scale per token and KV head, ``pagedkv.kernels.int8_kv``).
QUANTIZED_DTYPES = (*FP8_DTYPES, torch.int8)
CACHE_DTYPES = FLOAT_DTYPES + QUANTIZED_DTYPES
INT_DTYPES = (torch.int32, torch.int64)


def check_cache(name: str, cache: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """A KV cache tensor: ``[num_blocks, block_size, num_kv_heads, head_size]``."""
    if cache.ndim != 4:
        raise ValueError(f"{name}: expected [num_blocks, block_size, num_kv_heads, head_size]")
    if cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"{name}: dtype {cache.dtype} is not one of {CACHE_DTYPES}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")
    if like is not None and (
        cache.shape != like.shape or cache.dtype != like.dtype or cache.stride() != like.stride()
    ):
        raise ValueError(f"{name}: must match the key cache in shape, dtype and strides")


def check_block_storage(name: str, storage: torch.Tensor) -> None:
    """What block copies move: a contiguous ``[num_blocks, ...]`` tensor of
    a cache dtype (a cache, or an int8 cache's storage of values and
    scales)."""
    if storage.ndim < 2 or storage.dtype not in CACHE_DTYPES or not storage.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous [num_blocks, ...] tensor of one of {CACHE_DTYPES}"
        )


def check_kv_scales(
    key_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> int:
    """The scales of a quantized cache. An fp8 cache's
    (``pagedkv.kernels.fp8_kv``): float32, contiguous, ``[1]`` (per tensor)
    or ``[num_kv_heads]`` (per KV head), both of one shape. An int8 cache's
    (``pagedkv.kernels.int8_kv``): float16 ``[num_blocks, block_size,
    num_kv_heads]``, any strides, one per token and KV head, written with
    the values and read with them. On the cache's device; a cache in a
    float dtype takes none. Returns the scales' stride over KV heads: 0 or
    1 for fp8 (0 too without scales), the tensor's for int8."""
    if key_cache.dtype not in QUANTIZED_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale, v_scale: only a quantized cache has scales, not {key_cache.dtype}"
            )
        return 0
    num_kv_heads = key_cache.shape[2]
    per_token = key_cache.dtype == torch.int8
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"{name}: a {key_cache.dtype} cache needs its scales")
        if per_token:
            if (
                tuple(scale.shape) != tuple(key_cache.shape[:3])
                or scale.dtype != torch.float16
                or scale.device != key_cache.device
            ):
                raise ValueError(
                    f"{name}: expected a float16 {list(key_cache.shape[:3])} tensor (a scale "
                    f"per token and KV head) on {key_cache.device}"
                )
        elif (
            scale.ndim != 1
            or len(scale) not in (1, num_kv_heads)
            or scale.dtype != torch.float32
            or not scale.is_contiguous()
            or scale.device != key_cache.device
        ):
            raise ValueError(
                f"{name}: expected a contiguous float32 [1] or [{num_kv_heads}] tensor on "
                f"{key_cache.device}"
            )
    assert k_scale is not None and v_scale is not None
    if k_scale.shape != v_scale.shape or k_scale.stride() != v_scale.stride():
        raise ValueError("v_scale: must have k_scale's shape and strides")
    if per_token:
        return int(k_scale.stride(2))
    return int(len(k_scale) > 1)


def check_kv_input(name: str, tensor: torch.Tensor, cache: torch.Tensor) -> None:
    """New K or V (or a query) for ``cache``: of the cache's dtype, or of any
    float dtype when the cache is quantized."""
    if tensor.dtype not in FLOAT_DTYPES or (
        cache.dtype not in QUANTIZED_DTYPES and tensor.dtype != cache.dtype
    ):
        raise ValueError(f"{name}: dtype {tensor.dtype}, the cache holds {cache.dtype}")


def check_int_vector(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    """A contiguous 1-D int32/int64 tensor, of ``length`` elements when given."""
    if tensor.ndim != 1 or tensor.dtype not in INT_DTYPES or not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous 1-D int32/int64 tensor")
    if length is not None and len(tensor) != length:
        raise ValueError(f"{name}: {len(tensor)} entries, expected {length}")


def check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    sliding_window: int | None,
    softcap: float | None,
    scale: float,
) -> None:
    """The arguments of ``paged_attention``, as every backend needs them
    (``query_start_loc`` None: one token per sequence)."""
    check_cache("key_cache", key_cache)
    check_cache("value_cache", value_cache, like=key_cache)
    if query.ndim != 3 or query.dtype not in FLOAT_DTYPES or query.stride(-1) != 1:
        raise ValueError(
            "query: expected [num_tokens, num_q_heads, head_size], last dim contiguous"
        )
    num_q_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if head_size != key_cache.shape[3]:
        raise ValueError(f"query: head size {head_size}, the cache has {key_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query: {num_q_heads} heads is not a multiple of {num_kv_heads}")
    check_kv_input("query", query, key_cache)
    check_int_vector("seq_lens", seq_lens)
    if query_start_loc is not None:
        check_int_vector("query_start_loc", query_start_loc, len(seq_lens) + 1)
    elif len(query) != len(seq_lens):
        raise ValueError(f"query: {len(query)} tokens for {len(seq_lens)} one-token decodes")
    if block_table.ndim != 2 or block_table.dtype not in INT_DTYPES:
        raise ValueError("block_table: expected an int [num_seqs, max_blocks_per_seq] tensor")
    if block_table.stride(1) != 1 or block_table.shape[0] < len(seq_lens):
        raise ValueError("block_table: one contiguous row per sequence")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError("sliding_window: must be positive")
    if softcap is not None and softcap <= 0:
        raise ValueError("softcap: must be positive")
    if not 0 < scale < float("inf"):  # NaN fails too
        raise ValueError(f"scale: must be positive and finite, not {scale}")


def check_rotary_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The arguments of ``rotary_and_cache``, as every backend needs them."""
    check_cache("key_cache", key_cache)
    check_cache("value_cache", value_cache, like=key_cache)
    if query.ndim != 3 or query.stride(-1) != 1:
        raise ValueError(
            "query: expected [num_tokens, num_q_heads, head_size], last dim contiguous"
        )
    check_kv_input("query", query, key_cache)
    num_tokens, _, head_size = query.shape
    kv_shape = (num_tokens, *key_cache.shape[2:])
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != kv_shape or tensor.dtype != query.dtype:
            raise ValueError(f"{name}: {tuple(tensor.shape)}, expected {kv_shape} like query")
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous")
    if head_size % 2:
        raise ValueError(f"query: head size {head_size} is odd (rotation pairs dims)")
    if (
        cos_sin.ndim != 2
        or cos_sin.shape[1] != head_size
        or cos_sin.dtype not in FLOAT_DTYPES
        or not cos_sin.is_contiguous()
    ):
        raise ValueError(f"cos_sin: expected a contiguous float [max_position, {head_size}]")
    check_int_vector("positions", positions, num_tokens)
    check_int_vector("slot_mapping", slot_mapping, num_tokens)


def check_block_rows(
    name: str, caches: Sequence[torch.Tensor], block_ids: torch.Tensor, rows: torch.Tensor
) -> int:
    """The arguments of ``gather_blocks`` / ``scatter_blocks``: at least one
    contiguous cache, all of one shape, dtype and device; ``block_ids`` a
    1-D int vector on that device; ``rows`` (named ``name``) a contiguous
    ``[len(block_ids), len(caches) * block_numel]`` tensor of their dtype.
    Returns ``block_numel``, the elements of one cache's block."""
    if not caches:
        raise ValueError("caches: at least one is needed")
    first = caches[0]
    for i, cache in enumerate(caches):
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError(f"caches[{i}]: must match caches[0] in shape, dtype and device")
        if not cache.is_contiguous():
            raise ValueError(f"caches[{i}]: must be contiguous")
    check_int_vector("block_ids", block_ids)
    if block_ids.device != first.device:
        raise ValueError(f"block_ids: on {block_ids.device}, the caches on {first.device}")
    numel = first[0].numel()
    want = (len(block_ids), len(caches) * numel)
    if tuple(rows.shape) != want or rows.dtype != first.dtype or not rows.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {list(want)} tensor of {first.dtype}, got "
            f"{list(rows.shape)} of {rows.dtype}"
        )
    if rows.device != first.device:
        raise ValueError(f"{name}: on {rows.device}, the caches on {first.device}")
    return numel


MIN_ROTATED_HEAD_SIZE = 32
"""The smallest head size ``rotate`` takes (the Triton kernel multiplies each
half of a head by a matrix of at least 16 x 16)."""


def check_rotate(rotate: bool, head_size: int) -> None:
    """``rotate`` (the Hadamard basis, ``fp8_kv.hadamard``) needs a head size
    that is a power of two, at least ``MIN_ROTATED_HEAD_SIZE``."""
    if rotate and (head_size < MIN_ROTATED_HEAD_SIZE or head_size & (head_size - 1)):
        raise ValueError(
            f"rotate: needs a head size that is a power of two, at least "
            f"{MIN_ROTATED_HEAD_SIZE}, not {head_size}"
        )
