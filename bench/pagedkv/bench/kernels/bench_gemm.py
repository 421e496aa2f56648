"""``python -m pagedkv.bench.kernels.bench_gemm``: a decode step's projections on
a GPU, cuBLAS against the skinny Triton linear (``skinny_linear``).

For the ~1.1B llama of the executor bench (hidden 2048, intermediate
8192; and the Llama-3-8B shape at 64 rows), each projection of a decode
step — fused q/k/v, o, fused gate/up, down, the LM head — at 64 and 256
rows, timed as ``pagedkv bench kernels``
times (median of CUDA events, the L2 flushed by a read before each call):
``torch.nn.functional.linear`` (cuBLAS, the weight as transformers stores
it), the same with a zero bias (cuBLASLt's epilogue path), a matmul against
the weight transposed once ahead, and the Triton kernel under each tile of
a small grid, split along the input features or not (split, it is timed
with the sum of its partials and alone: the latter is what the projection
would cost with that sum done by the kernel that reads its output). The
bandwidth figure counts the weight, input and output bytes.
Writes every measurement to a JSON file and a markdown summary beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

from pagedkv.bench.kernels.bench import time_us
from pagedkv.kernels.skinny_linear import LinearTile, skinny_linear, skinny_linear_partials

# (model, projection, out_features, in_features)
PROJECTIONS = [
    ("llama-1.1b", "qkv", 3072, 2048),
    ("llama-1.1b", "o", 2048, 2048),
    ("llama-1.1b", "gate_up", 16384, 2048),
    ("llama-1.1b", "down", 2048, 8192),
    ("llama-1.1b", "lm_head", 32000, 2048),
    ("llama-8b", "qkv", 6144, 4096),
    ("llama-8b", "o", 4096, 4096),
    ("llama-8b", "gate_up", 28672, 4096),
    ("llama-8b", "down", 4096, 14336),
]
ROWS = {"llama-1.1b": (64, 256), "llama-8b": (64,)}


def tiles(rows: int) -> list[LinearTile]:
    """The Triton tiles tried at ``rows`` rows."""
    block_ms = (64,) if rows <= 64 else (64, 128)
    grid = itertools.product(block_ms, (16, 32, 64, 128), (128, 256), (1, 2, 4, 8))
    return [LinearTile(m, n, k, 4, 4, split) for m, n, k, split in grid if m * k <= 128 * 256]


def measure(
    model: str, name: str, out_features: int, in_features: int, rows: int
) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    x = torch.randn(rows, in_features, device="cuda", dtype=dtype, generator=gen)
    weight = torch.randn(out_features, in_features, device="cuda", dtype=dtype, generator=gen)
    weight_t = weight.t().contiguous()
    zero_bias = torch.zeros(out_features, device="cuda", dtype=dtype)
    want = (x.float() @ weight.float().T).to(dtype)
    moved = 2 * (out_features * in_features + rows * (in_features + out_features))

    def row(engine: str, us: float, **extra: Any) -> dict[str, Any]:
        return {
            "model": model,
            "projection": name,
            "rows": rows,
            "out_features": out_features,
            "in_features": in_features,
            "engine": engine,
            "us": us,
            "gbps": moved / us / 1e3,
            **extra,
        }

    results = [
        row("cublas linear", time_us(lambda: F.linear(x, weight))),
        row("cublaslt linear + bias", time_us(lambda: F.linear(x, weight, zero_bias))),
        row("cublas matmul, weight transposed ahead", time_us(lambda: x @ weight_t)),
    ]
    for tile in tiles(rows):
        try:
            got = skinny_linear(x, weight, tile)
            us = time_us(lambda: skinny_linear(x, weight, tile))  # noqa: B023 - called at once
        except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:
            print(f"skip {tile}: {exc}", flush=True)
            continue
        error = float((got.float() - want.float()).abs().max())
        results.append(row("triton skinny_linear", us, tile=list(tile), max_abs_error=error))
        if tile.split_k > 1:
            alone = time_us(lambda: skinny_linear_partials(x, weight, tile))  # noqa: B023
            results.append(row("triton partials alone", alone, tile=list(tile)))
    return results


def _cell(r: dict[str, Any] | None) -> str:
    return "-" if r is None else f"{r['us']:.1f} us, {r['gbps']:.0f} GB/s"


def _best(rows: list[dict[str, Any]], engine: str) -> str:
    candidates = [r for r in rows if r["engine"] == engine]
    if not candidates:
        return "-"
    fastest = min(candidates, key=lambda r: r["us"])
    return f"{_cell(fastest)} {tuple(fastest['tile'])}"


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        "# A decode step's projections (`python -m pagedkv.bench.kernels.bench_gemm`)",
        "",
        f"{header['gpu']}, torch {header['torch']}, triton {header['triton']}; bf16; "
        "L2 flushed by a read before each call; GB/s counts weight, input and output bytes.",
        "",
        "Tiles: (block_m, block_n, block_k, warps, stages, split_k).",
        "",
        "| model | projection | rows | out x in | cuBLAS linear | cuBLASLt + bias | "
        "transposed ahead | Triton best (tile) | Triton split, partials alone (tile) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["model"], r["projection"], r["rows"]) for r in rows}, key=str)
    for model, name, count in keys:
        mine = [r for r in rows if (r["model"], r["projection"], r["rows"]) == (model, name, count)]
        by_engine = {r["engine"]: r for r in mine if not r["engine"].startswith("triton")}

        first = mine[0]
        lines.append(
            f"| {model} | {name} | {count} | {first['out_features']} x {first['in_features']} | "
            f"{_cell(by_engine.get('cublas linear'))} | "
            f"{_cell(by_engine.get('cublaslt linear + bias'))} | "
            f"{_cell(by_engine.get('cublas matmul, weight transposed ahead'))} | "
            f"{_best(mine, 'triton skinny_linear')} | {_best(mine, 'triton partials alone')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.kernels.bench_gemm")
    parser.add_argument("--output", default="gemm-h200.json")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for model, name, out_features, in_features in PROJECTIONS:
        for count in ROWS[model]:
            rows += measure(model, name, out_features, in_features, count)
            torch.cuda.empty_cache()
    header = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    Path(args.output).write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")
    text = markdown(rows, header)
    Path(args.output).with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
