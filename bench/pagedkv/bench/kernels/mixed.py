"""Mixed prefill batches over quantized blocks: a prompt's chunk beside
decodes of long contexts, with the widening of ``dequant_blocks`` forced on
and off.

``paged_attention`` widens a batch's quantized blocks for the Gluon prefill
only within two limits (``PREFILL_DEQUANT_MAX_BYTES``, and
``PREFILL_DEQUANT_MAX_RATIO`` buffered tokens a new token); beyond them the
Triton kernel reads the quantized cache. The ratio counts every sequence's
context, a decode's included, while what the widening buys grows with the
chunk's own attention (its new tokens times its context). This bench times
each case both ways, the limits lifted for the widened one; split in two
launches (``paged_attention``'s ``split``: the decodes by the
flash-decoding kernel, then the chunk alone, widened within the limits);
and the same batch over bf16 blocks, packed and split; so that the bound,
and where to split, can be chosen from what each costs. A CUDA graph's
mixed step (``tiles``, no widening) is timed too, packed and with its
leading decodes in the graph's own decode launch over ``--slots`` slots
(``TiledDecodes``), over bf16 and the quantized blocks (a graph takes
steps of up to 1,024 tokens: for the longer cases these columns show
what the launches cost, not a step the executor replays):

    python -m pagedkv.bench.kernels.mixed --kv-cache-dtype fp8_e4m3 \\
        --cases 7680x0+15x7936,512x7168+15x7936 --output FILE.json

A case is ``NEWxCONTEXT+DECODESxLENGTH``: one chunk of NEW tokens over
CONTEXT cached ones, after DECODES one-token entries whose sequences reach
LENGTH tokens (the scheduler's order: decodes first), with the 8B shape's
32 query heads, 8 KV heads and head size 128 by default. Times are medians
over the L2 flushed by a read (bench.time_us).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from pagedkv.bench.kernels.bench import (
    BLOCK_SIZE,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    _environment,
    _write,
    stored_cache,
    time_us,
)
from pagedkv.kernels import dequant_blocks, fp8_kv, int8_kv, paged_attention
from pagedkv.kernels.decode_split import DecodeSplit, TiledDecodes

DEFAULT_CASES = (
    "7680x0+15x7936,4096x3584+15x7936,2048x5632+15x7936,512x7168+15x7936,"
    "7680x0+7x7936,2048x0+7x4096,512x0+63x1024"
)


@dataclass(frozen=True)
class MixedShape:
    """One chunk of ``new_tokens`` over ``context`` cached tokens, after
    ``decodes`` one-token entries whose sequences reach ``decode_len``."""

    new_tokens: int
    context: int
    decodes: int
    decode_len: int

    @property
    def seq_lens(self) -> list[int]:
        return [self.decode_len] * self.decodes + [self.context + self.new_tokens]

    @property
    def num_tokens(self) -> int:
        return self.new_tokens + self.decodes

    def label(self) -> str:
        return f"{self.new_tokens}x{self.context}+{self.decodes}x{self.decode_len}"


def parse_cases(text: str) -> list[MixedShape]:
    """``NEWxCONTEXT+DECODESxLENGTH,...``; a ``ValueError`` names a bad one."""
    shapes = []
    for part in text.split(","):
        try:
            chunk, decodes = part.split("+")
            new_tokens, context = (int(n) for n in chunk.split("x"))
            count, length = (int(n) for n in decodes.split("x"))
        except ValueError:
            raise ValueError(f"--cases: not NEWxCONTEXT+DECODESxLENGTH: {part!r}") from None
        if new_tokens < 2 or context < 0 or count < 0 or length < 1:
            raise ValueError(
                f"--cases: {part!r} needs a chunk of at least 2 tokens and decodes of 1 or more"
            )
        shapes.append(MixedShape(new_tokens, context, count, length))
    return shapes


class MixedBatch:
    """A mixed batch's packed query and paged K/V (shuffled block tables),
    the decodes first (the scheduler's order), the cache in bf16 and, when
    asked, quantized as the executor stores it; ``rest`` describes the
    chunk for ``paged_attention``'s ``split`` (None without decodes)."""

    def __init__(
        self,
        shape: MixedShape,
        kv_dtype: torch.dtype,
        head_size: int = 128,
        device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.shape = shape
        seq_lens = shape.seq_lens
        pages = [-(-n // BLOCK_SIZE) for n in seq_lens]
        num_blocks = 1 + sum(pages)
        perm = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).tolist()
        table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
        start = 0
        for entry, count in enumerate(pages):
            table[entry, :count] = torch.tensor(perm[start : start + count], dtype=torch.int32)
            start += count
        self.block_table = table.to(device)
        cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size)
        key = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
        value = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
        self.query = torch.randn(
            shape.num_tokens, NUM_Q_HEADS, head_size, generator=gen, device=device, dtype=dtype
        )
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        starts = [*range(shape.decodes + 1), shape.num_tokens]
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        self.rest: DecodeSplit | None = None
        if shape.decodes:
            self.rest = DecodeSplit(
                num_decodes=shape.decodes,
                decode_max_seq_len=shape.decode_len,
                block_table=self.block_table[shape.decodes :].clone(),
                seq_lens=self.seq_lens[shape.decodes :].clone(),
                query_start_loc=torch.tensor(
                    [0, shape.new_tokens], dtype=torch.int32, device=device
                ),
                max_query_len=shape.new_tokens,
                max_seq_len=shape.context + shape.new_tokens,
            )
        self.scale = head_size**-0.5
        Caches = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
        self.bf16: Caches = (key, value, {})
        self.caches: Caches = self.bf16
        if kv_dtype != dtype:
            key_cache, k_scale = stored_cache(key, kv_dtype)
            value_cache, v_scale = stored_cache(value, kv_dtype)
            self.caches = (key_cache, value_cache, {"k_scale": k_scale, "v_scale": v_scale})

    def run(self, quantized: bool = True, split: bool = False) -> torch.Tensor:
        """The batch in one call of ``paged_attention``: one launch, or with
        ``split`` the decodes' and the chunk's."""
        key_cache, value_cache, scales = self.caches if quantized else self.bf16
        return paged_attention.paged_attention(
            self.query,
            key_cache,
            value_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            max_query_len=self.shape.new_tokens,
            max_seq_len=max(self.shape.seq_lens),
            k_scale=scales.get("k_scale"),
            v_scale=scales.get("v_scale"),
            split=self.rest if split else None,
        )

    def tiled(self, slots: int, max_model_len: int) -> None:
        """Sets what a CUDA graph's mixed step reads: its entries padded to
        ``min(slots, tokens)`` (as a graph holds them: no tokens, no
        length), its schedule of every query tile with spare programs
        (``tiles``), and the same without the decodes (``tiles_split``),
        which its decode launch takes over those slots, sized for
        ``max_model_len`` (``tiled_decodes``)."""
        from pagedkv.executor.mixed_graphs import tile_schedule

        shape, device = self.shape, self.query.device
        entries = shape.decodes + 1
        padded = max(entries, min(slots, shape.num_tokens))
        self.padded_table = torch.zeros(
            padded, self.block_table.shape[1], dtype=torch.int32, device=device
        )
        self.padded_table[:entries] = self.block_table
        self.padded_lens = torch.zeros(padded, dtype=torch.int32, device=device)
        self.padded_lens[:entries] = self.seq_lens
        self.padded_starts = torch.full(
            (padded + 1,), shape.num_tokens, dtype=torch.int32, device=device
        )
        self.padded_starts[: entries + 1] = self.query_start_loc
        rows = paged_attention.tile_rows(shape.new_tokens, self.query.shape[-1])
        num_tiles = -(-shape.num_tokens // rows) + padded
        computed = np.array([shape.decode_len - 1] * shape.decodes + [shape.context])
        scheduled = np.array([1] * shape.decodes + [shape.new_tokens])
        self.tiles, self.tiles_split = (
            torch.from_numpy(tile_schedule(computed, n, rows, num_tiles)).to(device, torch.int32)
            for n in (scheduled, np.where(scheduled == 1, 0, scheduled))
        )
        lens = torch.ones(padded, dtype=torch.int32)
        lens[: shape.decodes] = shape.decode_len
        self.tiled_decodes = TiledDecodes(padded, lens.to(device), max_model_len)

    def run_tiled(self, quantized: bool = True, split: bool = False) -> torch.Tensor:
        """The batch as a CUDA graph's mixed step runs it: the schedule,
        with ``split`` its decodes in their own launch first."""
        key_cache, value_cache, scales = self.caches if quantized else self.bf16
        return paged_attention.paged_attention(
            self.query,
            key_cache,
            value_cache,
            self.padded_table,
            self.padded_lens,
            self.padded_starts,
            self.scale,
            max_query_len=self.shape.new_tokens,
            max_seq_len=self.tiled_decodes.max_seq_len,
            tiles=self.tiles_split if split else self.tiles,
            k_scale=scales.get("k_scale"),
            v_scale=scales.get("v_scale"),
            split=self.tiled_decodes if split else None,
        )

    def buffer(self) -> tuple[int, int]:
        """The widening's buffer: its bytes and its tokens (``dequant_blocks``)."""
        key_cache = self.caches[0]
        entries, longest = len(self.shape.seq_lens), max(self.shape.seq_lens)
        return (
            dequant_blocks.buffer_bytes(entries, longest, key_cache, self.query.dtype),
            dequant_blocks.buffer_tokens(entries, longest, BLOCK_SIZE),
        )


def measure(batch: MixedBatch, slots: int = 256, max_model_len: int = 8192) -> dict[str, Any]:
    """One row: the batch over bf16 blocks, over quantized ones widened (both
    limits lifted) and not widened, and split in two launches (the decodes
    by the decode kernel, the chunk widened within the default limits); then
    as a CUDA graph's step (``MixedBatch.tiled``), packed and split, over
    bf16 and quantized blocks."""
    pa = paged_attention
    limits = (pa.PREFILL_DEQUANT_MAX_BYTES, pa.PREFILL_DEQUANT_MAX_RATIO)
    buffer_bytes, buffer_tokens = batch.buffer()
    shape = batch.shape
    chunk_flops = (
        4 * NUM_Q_HEADS * batch.query.shape[-1] * shape.new_tokens
        * (shape.context + shape.new_tokens / 2)
    )  # fmt: skip
    row: dict[str, Any] = {
        "case": shape.label(),
        "new_tokens": shape.new_tokens,
        "context": shape.context,
        "decodes": shape.decodes,
        "decode_len": shape.decode_len,
        "buffer_tokens_per_new_token": buffer_tokens / shape.num_tokens,
        "buffer_mib": buffer_bytes / 2**20,
        "bf16_us": time_us(lambda: batch.run(quantized=False)),
    }
    switch = pa.PREFILL_SPLIT_DECODES
    try:
        pa.PREFILL_DEQUANT_MAX_BYTES, pa.PREFILL_DEQUANT_MAX_RATIO = 1 << 62, 1 << 62
        with pa.widening(True):
            widened = batch.run()
            row["widened_us"] = time_us(batch.run)
        with pa.widening(False):
            unwidened = batch.run()
            row["unwidened_us"] = time_us(batch.run)
        pa.PREFILL_DEQUANT_MAX_BYTES, pa.PREFILL_DEQUANT_MAX_RATIO = limits
        pa.PREFILL_SPLIT_DECODES = True  # timed whatever the default
        split = batch.run(split=True)
        row["split_us"] = time_us(lambda: batch.run(split=True))
        row["bf16_split_us"] = time_us(lambda: batch.run(quantized=False, split=True))
        batch.tiled(slots, max_model_len)
        tiled = batch.run_tiled()
        tiled_split = batch.run_tiled(split=True)
        for name, quantized in (("tiled_bf16", False), ("tiled", True)):
            row[f"{name}_us"] = time_us(partial(batch.run_tiled, quantized))
            row[f"{name}_split_us"] = time_us(partial(batch.run_tiled, quantized, True))
    finally:
        pa.PREFILL_DEQUANT_MAX_BYTES, pa.PREFILL_DEQUANT_MAX_RATIO = limits
        pa.PREFILL_SPLIT_DECODES = switch
    row["max_abs_diff_split_unwidened"] = float((split.float() - unwidened.float()).abs().max())
    row["max_abs_diff_tiled_split"] = float((tiled_split.float() - tiled.float()).abs().max())
    row["decode_slots"] = batch.tiled_decodes.num_slots
    row["widened_vs_unwidened"] = row["widened_us"] / row["unwidened_us"]
    row["max_abs_diff_widened_unwidened"] = float((widened.float() - unwidened.float()).abs().max())
    row["chunk_tflops_widened"] = chunk_flops / row["widened_us"] / 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.kernels.mixed")
    parser.add_argument("--output", default="kernels-mixed.json")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="NEWxCONTEXT+DECODESxLENGTH,...")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=(*fp8_kv.KV_CACHE_DTYPES, *int8_kv.KV_CACHE_DTYPES),
        default="fp8_e4m3",
    )
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument(
        "--slots", type=int, default=256, help="a graph's entries at most (max_num_seqs)"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=8192, help="a graph's decode launch is sized for it"
    )
    args = parser.parse_args(argv)
    try:
        shapes = parse_cases(args.cases)
    except ValueError as error:
        parser.error(str(error))
    kv_dtype = {**fp8_kv.KV_CACHE_DTYPES, **int8_kv.KV_CACHE_DTYPES}[args.kv_cache_dtype]
    rows = []
    for shape in shapes:
        batch = MixedBatch(shape, kv_dtype, args.head_size)
        rows.append(measure(batch, args.slots, args.max_model_len))
        torch.cuda.empty_cache()
    results = _environment() | {
        "kv_cache_dtype": args.kv_cache_dtype,
        "head_size": args.head_size,
        "q_heads": NUM_Q_HEADS,
        "kv_heads": NUM_KV_HEADS,
        "limits": {
            "PREFILL_DEQUANT_MAX_BYTES": paged_attention.PREFILL_DEQUANT_MAX_BYTES,
            "PREFILL_DEQUANT_MAX_RATIO": paged_attention.PREFILL_DEQUANT_MAX_RATIO,
        },
        "slots": args.slots,
        "max_model_len": args.max_model_len,
        "rows": rows,
    }
    lines = [
        f"{args.kv_cache_dtype} blocks, head size {args.head_size}, on {results['gpu']}",
        "case (chunk NEWxCONTEXT + DECODESxLENGTH): bf16 blocks | widened | unwidened"
        " (widened/unwidened) | split | bf16 split"
        " | buffer tokens a new token, MiB (limits in the JSON)"
        " || as a graph's step: bf16 packed | bf16 split | packed | split",
    ]
    for row in rows:
        lines.append(
            f"{row['case']:>22}: {row['bf16_us']:9.1f} | {row['widened_us']:9.1f}"
            f" | {row['unwidened_us']:9.1f} us (x{row['widened_vs_unwidened']:.2f})"
            f" | {row['split_us']:9.1f} | {row['bf16_split_us']:9.1f}"
            f" | {row['buffer_tokens_per_new_token']:7.1f}, {row['buffer_mib']:6.0f}"
            f" || {row['tiled_bf16_us']:9.1f} | {row['tiled_bf16_split_us']:9.1f}"
            f" | {row['tiled_us']:9.1f} | {row['tiled_split_us']:9.1f}"
        )
    return _write(args.output, results, lines, "Mixed batches over quantized blocks")


if __name__ == "__main__":
    sys.exit(main())
