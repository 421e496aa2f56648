"""Registers ``pagedkv bench kernels`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.common.cli import requires


@requires("pagedkv.kernels")  # torch and Triton on a CUDA GPU
def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="paged-attention kernels on a CUDA GPU against torch SDPA",
        description="Copy ceiling, decode and prefill attention, CUDA-graph decode latency, "
        "and the fused layer ops against transformers' modules.",
    )
    parser.add_argument("--output", default="kernels-h200.json")
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--fused-only", action="store_true", help="only the fused layer ops")
    parser.add_argument(
        "--kv-cache-dtype",
        default="bfloat16",
        help="bfloat16 (the default), fp8_e4m3 or fp8_e5m2: the paged K/V's dtype",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pagedkv.bench.kernels.bench import main

    argv = ["--output", args.output] + (["--quick"] if args.quick else [])
    argv += ["--fused-only"] if args.fused_only else []
    argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    return main(argv)
