"""``pagedkv bench kernels``: the paged-attention kernels on a GPU.

Measures, in one run: the device-to-device copy bandwidth (the ceiling), then
decode and prefill attention through ``paged_attention`` on shuffled block
tables against torch SDPA (the best of its cuDNN and flash backends) on the
same K/V laid out contiguously, and small-batch decode latency under CUDA
graph replay. Times are medians of CUDA-event timings with the L2 flushed
before each call, by a read (clean lines) and, in extra columns, by a write
(dirty lines; see ``time_us``). Writes a JSON file of rows and a markdown
summary. With ``--kv-cache-dtype fp8_e4m3`` (or ``fp8_e5m2``) the paged
K/V are stored in fp8 with per-tensor scales (``pagedkv.kernels.fp8_kv``):
bandwidth counts fp8 bytes, SDPA still reads bf16, and the error against it
includes the quantization's. ``--kv-cache-dtype int8`` stores them as int8
with a scale per token and KV head (``pagedkv.kernels.int8_kv``, laid out
as the executor lays them out): bandwidth counts the values' bytes and the
scales'.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from pagedkv.kernels import fp8_kv, int8_kv
from pagedkv.kernels.paged_attention import paged_attention

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


FLUSHES = ("read", "write")


def time_us(fn: Callable[[], object], iters: int = 20, flush: str | None = "read") -> float:
    """Median µs of ``fn`` over ``iters`` calls, the L2 flushed before each.

    ``flush="read"`` evicts the L2 by reading a 256 MB buffer, leaving it full
    of clean lines; ``"write"`` zero-fills the buffer instead (the usual
    flush), leaving dirty lines whose write-back the timed call then pays for
    (measured on the H200: about 8 µs of a decode reading 134 MB, ours and
    cuDNN's alike). ``None`` leaves the L2 as it is. The GPU is kept busy (a
    spin) while the host enqueues the timed call, so that the host's launch
    overhead does not count: the figure is GPU time.
    """
    if flush not in (None, *FLUSHES):
        raise ValueError(f"flush must be one of {FLUSHES} or None, not {flush!r}")
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    fn()
    times = []
    for _ in range(iters):
        if flush == "read":
            cache.sum(dtype=torch.int32)
        elif flush == "write":
            cache.zero_()
        torch.cuda._sleep(2_000_000)  # about a millisecond
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return float(statistics.median(times))


def copy_ceiling_gbps(num_bytes: int = 4 * 1024**3) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters=10, flush=None)
    return 2 * num_bytes / us / 1e3


def stored_cache(cache: torch.Tensor, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache`` (``[num_blocks, block_size, num_kv_heads, head_size]``)
    stored as an executor stores ``kv_dtype`` blocks, and its scale: int8
    with a scale per token and KV head (laid out as ``int8_kv`` lays them
    out), fp8 with one per tensor."""
    if kv_dtype == torch.int8:
        num_blocks, block_size, num_kv_heads, head_size = cache.shape
        _, values, scales = int8_kv.block_storage(
            num_blocks, block_size, num_kv_heads, head_size, device=cache.device
        )
        for start in range(0, len(cache), 4096):  # float32 copies a slice at a time
            part = slice(start, start + 4096)
            scales[part] = int8_kv.token_scales(cache[part])
            values[part] = int8_kv.quantize(cache[part], scales[part])
        return values, scales
    scale = fp8_kv.calibrated_scale(cache, kv_dtype, per_head=False)
    return fp8_kv.quantize(cache, scale, kv_dtype), scale


class Case:
    """One batch: paged K/V behind shuffled block tables, and the same K/V contiguous."""

    def __init__(
        self,
        batch: int,
        context: int,
        new_tokens: int,
        head_size: int = HEAD_SIZE,
        kv_dtype: torch.dtype = DTYPE,
    ) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.batch, self.context, self.new_tokens = batch, context, new_tokens
        self.head_size = head_size
        seq_len = context + new_tokens
        blocks_per_seq = triton.cdiv(seq_len, BLOCK_SIZE)
        num_blocks = 1 + batch * blocks_per_seq
        perm = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
        self.block_table = perm.view(batch, blocks_per_seq).to(torch.int32)
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size)
        self.key_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
        self.value_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
        self.query = torch.randn(
            batch * new_tokens, NUM_Q_HEADS, head_size, device="cuda", dtype=DTYPE, generator=gen
        )
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
        self.query_start_loc = torch.arange(
            0, (batch + 1) * new_tokens, new_tokens, dtype=torch.int32, device="cuda"
        )

        # Contiguous [batch, heads, seq_len, head_size] copies for SDPA.
        def contiguous(cache: torch.Tensor) -> torch.Tensor:
            pages = cache[self.block_table.long()]  # [B, blocks, bs, H, D]
            flat = pages.reshape(batch, blocks_per_seq * BLOCK_SIZE, NUM_KV_HEADS, head_size)
            return flat[:, :seq_len].transpose(1, 2).contiguous()

        self.k, self.v = contiguous(self.key_cache), contiguous(self.value_cache)
        self.q = self.query.view(batch, new_tokens, NUM_Q_HEADS, head_size).transpose(1, 2)
        self.scale = head_size**-0.5
        self.kv_scales: dict[str, torch.Tensor] = {}
        if kv_dtype != DTYPE:  # the paged copies quantized, SDPA's kept
            self.key_cache, self.kv_scales["k_scale"] = stored_cache(self.key_cache, kv_dtype)
            self.value_cache, self.kv_scales["v_scale"] = stored_cache(self.value_cache, kv_dtype)

    def ours(self) -> torch.Tensor:
        return paged_attention(
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            max_query_len=self.new_tokens,
            max_seq_len=self.context + self.new_tokens,
            k_scale=self.kv_scales.get("k_scale"),
            v_scale=self.kv_scales.get("v_scale"),
        )

    def sdpa(self, backend: SDPBackend) -> torch.Tensor:
        mask = None
        if self.new_tokens > 1:
            mask = causal_lower_right(self.new_tokens, self.context + self.new_tokens)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(
                self.q, self.k, self.v, attn_mask=mask, scale=self.scale, enable_gqa=True
            )

    def best_sdpa_us(self, flush: str = "read") -> tuple[float, str]:
        best = (float("inf"), "none")
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            try:
                us = time_us(lambda: self.sdpa(backend), flush=flush)  # noqa: B023 - called at once
            except RuntimeError:
                continue  # the backend does not take this shape
            best = min(best, (us, backend.name))
        return best

    def max_error_vs_sdpa(self) -> float:
        ours = self.ours().view(self.batch, self.new_tokens, NUM_Q_HEADS, self.head_size)
        with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):
            ref = self.sdpa(SDPBackend.FLASH_ATTENTION).transpose(1, 2)
        return float((ours.float() - ref.float()).abs().max())

    def kv_bytes(self) -> int:
        """K and V bytes read, an int8 cache's scales included."""
        tokens = self.batch * (self.context + self.new_tokens)
        per_token = self.head_size * self.key_cache.element_size()
        if self.key_cache.dtype == torch.int8:
            per_token += int8_kv.SCALE_BYTES
        return 2 * tokens * NUM_KV_HEADS * per_token

    def flops(self) -> float:
        q, ctx = self.new_tokens, self.context
        return 4 * self.batch * NUM_Q_HEADS * self.head_size * (q * ctx + q * q / 2)


def measure(case: Case, kind: str, ceiling: float) -> dict[str, Any]:
    """One row: ours and the best SDPA after a clean (read) L2 flush, and the
    same after a dirty (write) one under ``*_write_flush``."""
    row: dict[str, Any] = {
        "kind": kind,
        "batch": case.batch,
        "context": case.context,
        "new_tokens": case.new_tokens,
        "max_abs_error_vs_sdpa": case.max_error_vs_sdpa(),
    }
    for flush in FLUSHES:
        suffix = "" if flush == "read" else f"_{flush}_flush"
        ours_us = time_us(case.ours, flush=flush)
        sdpa_us, backend = case.best_sdpa_us(flush)
        row |= {
            f"us{suffix}": ours_us,
            f"sdpa_us{suffix}": sdpa_us,
            f"sdpa_backend{suffix}": backend,
            f"ratio_vs_sdpa{suffix}": ours_us / sdpa_us,
        }
        if kind == "decode":
            row[f"gbps{suffix}"] = case.kv_bytes() / ours_us / 1e3
            row[f"pct_ceiling{suffix}"] = 100 * row[f"gbps{suffix}"] / ceiling
        else:
            row[f"tflops{suffix}"] = case.flops() / ours_us / 1e6
    return row


def graph_latency_us(batch: int, context: int, kv_dtype: torch.dtype = DTYPE) -> float:
    """Decode latency replaying a captured CUDA graph (L2 warm: back-to-back steps)."""
    case = Case(batch, context, 1, kv_dtype=kv_dtype)
    case.ours()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        case.ours()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.ours()
    return time_us(graph.replay, iters=50, flush=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv bench kernels")
    parser.add_argument("--output", default="kernels-h200.json")
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument(
        "--fused-only", action="store_true", help="only the fused layer ops (bench_fused)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("bfloat16", *fp8_kv.KV_CACHE_DTYPES, *int8_kv.KV_CACHE_DTYPES),
        default="bfloat16",
        help="the paged K/V's dtype (default bfloat16); fp8 and int8 runs leave the fused ops out",
    )
    args = parser.parse_args(argv)
    from pagedkv.bench.kernels import bench_fused

    formats = {**fp8_kv.KV_CACHE_DTYPES, **int8_kv.KV_CACHE_DTYPES}
    kv_dtype = formats.get(args.kv_cache_dtype, DTYPE)
    fused_rows = bench_fused.run(args.quick) if kv_dtype == DTYPE else []
    if args.fused_only:
        results = _environment() | {"fused_ops": fused_rows}
        return _write(args.output, results, bench_fused.summary(fused_rows), "Fused layer ops")
    ceiling = copy_ceiling_gbps()
    rows = []
    batches, contexts = ((1, 32), (1024,)) if args.quick else ((1, 32, 128), (1024, 8192, 32768))
    for batch in batches:
        for context in contexts:
            rows.append(measure(Case(batch, context, 1, kv_dtype=kv_dtype), "decode", ceiling))
            torch.cuda.empty_cache()
    prefill = [(8, 0, 2048), (8, 4096, 512)] if not args.quick else [(2, 0, 256)]
    for batch, context, new_tokens in prefill:
        case = Case(batch, context, new_tokens, kv_dtype=kv_dtype)
        rows.append(measure(case, "prefill", ceiling))
        torch.cuda.empty_cache()
    graphs = [
        {"batch": b, "context": 1024, "us": graph_latency_us(b, 1024, kv_dtype)} for b in (1, 8)
    ]
    results = _environment() | {
        "copy_ceiling_gbps": ceiling,
        "l2_flush": "read (a 256 MB buffer); *_write_flush: a zero-fill of it",
        "shape": {
            "q_heads": NUM_Q_HEADS,
            "kv_heads": NUM_KV_HEADS,
            "head_size": HEAD_SIZE,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
            "kv_cache_dtype": args.kv_cache_dtype,
        },
        "rows": rows,
        "cuda_graph_decode": graphs,
        "fused_ops": fused_rows,
    }
    lines = [
        f"copy ceiling: {ceiling:.0f} GB/s on {results['gpu']}",
        "L2 flushed by a read before each call; [after a write flush] in brackets",
    ]
    for row in rows:
        if row["kind"] == "decode":
            speed = (
                f"{row['gbps']:.0f} GB/s ({row['pct_ceiling']:.0f}% of ceiling)"
                f" [{row['pct_ceiling_write_flush']:.0f}%]"
            )
        else:
            speed = f"{row['tflops']:.1f} TFLOP/s [{row['tflops_write_flush']:.1f}]"
        lines.append(
            f"{row['kind']:7} b={row['batch']:<4} ctx={row['context']:<6} q={row['new_tokens']:<5}"
            f" {row['us']:9.1f} us [{row['us_write_flush']:.1f}]  {speed}"
            f"  x{row['ratio_vs_sdpa']:.2f} [x{row['ratio_vs_sdpa_write_flush']:.2f}]"
            f" vs SDPA {row['sdpa_backend']}"
            f"  err {row['max_abs_error_vs_sdpa']:.3g}"
        )
    lines += [f"graph decode b={g['batch']} ctx={g['context']}: {g['us']:.1f} us" for g in graphs]
    lines += bench_fused.summary(fused_rows) if fused_rows else []
    return _write(args.output, results, lines, "Paged-attention and fused layer kernels")


def _environment() -> dict[str, Any]:
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def _write(output: str, results: dict[str, Any], lines: list[str], title: str) -> int:
    """``output`` (JSON) and the same name with ``.md`` (the summary lines)."""
    Path(output).write_text(json.dumps(results, indent=2) + "\n")
    text = "\n".join(lines)
    print(text)
    Path(output).with_suffix(".md").write_text(
        f"# {title} (`pagedkv bench kernels`)\n\n```\n{text}\n```\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
