"""Compiles the cache and attention kernels for an H100/H200 (sm_90) on a
machine without a GPU: every launch of the kernels' own launchers only
compiles (Triton's warm-up path, down to ``ptxas``), through a driver that
names the target and launches nothing. Triton's interpreter accepts code
the GPU compiler refuses (a shape it broadcasts, a type it promotes), so
this is the CPU's check that every variant a GPU would build does build:
each cache dtype (float16, bfloat16, e4m3, int8), the writes (rotated or
not), prefill and decode attention (window, soft-cap, a tile schedule,
the block table's read-ahead, widened V tiles and scaled int8 tiles on
and off), the Gluon prefill (float16 and bfloat16; warps of their own or not), the one-launch decode
(rotated or not), the widening of fp8 and int8 blocks for the Gluon
prefill and the block moves.

    python -m tests.kernels.sm90_compile   # prints the kernels built; exit 1 on a failure

Run in a process of its own: ``TRITON_INTERPRET`` must be unset before
any kernel is defined (tests/conftest.py sets it for the tests).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

import torch

from pagedkv.bench.kernels.compile_only import BUILT, install

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)


def _caches(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """K and V caches of ``dtype`` (as the executor lays them out) and
    their scale arguments; the storage the block moves take."""
    from pagedkv.kernels import int8_kv

    if dtype == torch.int8:
        key, value = (int8_kv.block_storage(*shape) for _ in range(2))
        scales = {"k_scale": key[2], "v_scale": value[2]}
        return [key[1], value[1], key[0], value[0]], scales
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    scales = {}
    if dtype.itemsize == 1:
        scales = {name: torch.ones(shape[2]) for name in ("k_scale", "v_scale")}
    return [*caches, *caches], scales


def _variants(dtype: torch.dtype) -> None:
    from pagedkv.kernels import cache_ops, decode_attention, paged_attention, rotary

    model_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    heads, kv_heads, head_size, block_size, num_blocks = 8, 2, 64, 16, 64
    (key_cache, value_cache, *storage), scales = _caches(
        dtype, (num_blocks, block_size, kv_heads, head_size)
    )
    tokens = 40
    query = torch.zeros(tokens, heads, head_size, dtype=model_dtype)
    key = torch.zeros(tokens, kv_heads, head_size, dtype=model_dtype)
    slots = torch.arange(tokens, dtype=torch.int64)
    positions = torch.arange(tokens, dtype=torch.int64)
    cos_sin = torch.zeros(128, head_size, dtype=model_dtype)
    cache_ops.reshape_and_cache(key, key, key_cache, value_cache, slots, **scales)
    for rotate in (False, True):
        rotary.rotary_and_cache(
            query, key, key, cos_sin, positions, key_cache, value_cache, slots,
            rotate=rotate, **scales,
        )  # fmt: skip
    table = torch.arange(1, 1 + 4 * 8, dtype=torch.int32).view(4, 8)
    mixed = (torch.tensor([40, 20, 17, 1], dtype=torch.int32), [0, 16, 17, 18, 19])
    decodes = (torch.tensor([40, 100, 17, 1], dtype=torch.int32), [0, 1, 2, 3, 4])
    settings = [(None, None), (7, None), (None, 5.0)]
    # Read-ahead, widened V tiles, scaled int8 tiles and int8 widened in
    # PTX (their defaults, then flipped).
    flags = [(True, True, False, True, False, True), (False, False, True, False, True, False)]
    for prefetch, widen, decode_tiles, prefill_tiles, decode_ptx, prefill_ptx in flags:
        decode_attention.DECODE_FP8_PREFETCH = decode_attention.DECODE_PREFETCH = prefetch
        decode_attention.DECODE_FP8_WIDEN_V = paged_attention.PREFILL_FP8_WIDEN_V = widen
        decode_attention.DECODE_INT8_SCALE_TILES = decode_tiles
        paged_attention.PREFILL_INT8_SCALE_TILES = prefill_tiles
        decode_attention.DECODE_INT8_PTX = decode_ptx
        paged_attention.PREFILL_INT8_PTX = prefill_ptx
        for seq_lens, starts in (mixed, decodes):
            start_loc = torch.tensor(starts, dtype=torch.int32)
            q = query[: starts[-1]]
            for window, softcap in settings:
                paged_attention.paged_attention(
                    q, key_cache, value_cache, table, seq_lens, start_loc, 0.125,
                    window, softcap, **scales,
                )  # fmt: skip
        tiles = torch.tensor([[1, 0, 2, -1], [0, 0, 0, 0]], dtype=torch.int32)
        paged_attention.paged_attention(
            query[:19], key_cache, value_cache, table, mixed[0], torch.tensor(mixed[1],
            dtype=torch.int32), 0.125, max_query_len=16, max_seq_len=40, tiles=tiles, **scales,
        )  # fmt: skip
        for rotate in (False, True):
            paged_attention.rotary_decode_attention(
                query[:4], key[:4], key[:4], cos_sin, positions[:4], key_cache, value_cache,
                slots[:4], table, decodes[0], 0.125, rotate=rotate, **scales,
            )  # fmt: skip
    if dtype in (torch.float16, torch.bfloat16):
        _gluon_prefill(dtype, table, mixed)
    else:  # the blocks a Gluon prefill over them widens (dequant_blocks)
        from pagedkv.kernels import dequant_blocks
        from pagedkv.kernels.kv_quant import scale_args

        seq_lens = mixed[0]
        args = scale_args(key_cache, scales["k_scale"], scales["v_scale"], seq_lens)
        for out_dtype in (torch.float16, torch.bfloat16):
            dequant_blocks.dequantize_blocks(
                key_cache, value_cache, table, seq_lens, 40, args, out_dtype
            )
    pairs = torch.tensor([[1, 2], [3, 4]])
    cache_ops.copy_blocks(storage[:1], storage[1:], pairs)
    ids = torch.tensor([5, 6])
    rows = torch.zeros(2, 2 * storage[0][0].numel(), dtype=storage[0].dtype)
    cache_ops.gather_blocks(storage, ids, rows)
    cache_ops.scatter_blocks(storage, ids, rows)


def _gluon_prefill(
    dtype: torch.dtype, table: torch.Tensor, mixed: tuple[torch.Tensor, list[int]]
) -> None:
    """The Gluon prefill (sm_90 only) at head sizes 64 and 128, with a tile
    schedule and without."""
    from pagedkv.kernels import prefill_gluon

    seq_lens, starts = mixed
    start_loc = torch.tensor(starts, dtype=torch.int32)
    tiles = torch.tensor([[1, 0, 2, -1], [0, 0, 0, 0]], dtype=torch.int32)
    default = prefill_gluon.TILING
    for head_size in default:
        query = torch.zeros(starts[-1], 8, head_size, dtype=dtype)
        cache = torch.zeros(64, 16, 2, head_size, dtype=dtype)
        # The default tiling (schedule 8: warps of their own in persistent
        # programs, pages copied by the Tensor Memory Accelerator) and
        # schedule 1 (every warpgroup copies), each with a tile schedule
        # and without; warps of their own (schedule 3), taking turns at the
        # tensor cores (4), their pages copied by the Tensor Memory
        # Accelerator (6); persistent programs (5), with 64- and 128-key
        # tiles.
        for tiling, schedule in (
            (default[head_size], None),
            (default[head_size], tiles),
            ((64, 4, 3, 128), tiles),
            ((64, 4, 1, 128), None),
            ((64, 4, 1, 128), tiles),
            ((64, 3, 4, 128), None),
            ((64, 4, 6, 128), tiles),
            ((64, 4, 5, 128), None),
            ((128, 3, 5, 128), tiles),
            ((64, 4, 8, 128), None),
        ):
            prefill_gluon.TILING = {head_size: tiling}
            try:
                prefill_gluon.prefill(
                    query, cache, cache, table, seq_lens, start_loc, torch.empty_like(query),
                    0.125, 128, schedule,
                )  # fmt: skip
            finally:
                prefill_gluon.TILING = default


def main() -> int:
    install()
    failures = {}
    for dtype in CACHE_DTYPES:
        try:
            _variants(dtype)
        except Exception as error:  # each dtype's failure is reported
            failures[str(dtype)] = f"{type(error).__name__}: {error}"[:2000]
    built = Counter(kernel.name for kernel in BUILT)
    from pagedkv.bench.kernels.sass import machine_code

    # Each Gluon build's warpgroup products and its waits on them.
    products: dict[str, list[list[int]]] = {"gluon": [], "specialized": [], "persistent": []}
    for kernel in BUILT:
        kind = {
            "_prefill_kernel": "gluon",
            "prefill_specialized_kernel": "specialized",
            "prefill_persistent_kernel": "persistent",
        }
        if kernel.name in kind:
            code = machine_code(kernel.asm["cubin"])
            products[kind[kernel.name]].append([code["products"], code["product_waits"]])
    report = {"target": "sm_90", "built": dict(built), "failures": failures, **products}
    print(json.dumps(report, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
