"""``python -m pagedkv.kernels.tune``: sweeps the launch constants of
``paged_attention`` on a GPU and prints the best per shape.

The constants live in ``pagedkv.kernels.decode_attention`` (``DECODE_*``)
and ``pagedkv.kernels.paged_attention`` (``PREFILL_TILE``); this sets them,
times the benchmark's shapes with the same timer as ``pagedkv bench
kernels``, and writes every measurement to a JSON file, so that a choice of
constants can be traced to its numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton

from pagedkv.kernels import decode_attention as da
from pagedkv.kernels import paged_attention as pa
from pagedkv.kernels.bench import Case, time_us

DECODE_SHAPES = [
    (1, 1024),
    (1, 8192),
    (1, 32768),
    (4, 32768),
    (8, 32768),
    (32, 1024),
    (32, 8192),
    (128, 1024),
    (128, 8192),
]
PREFILL_SHAPES = [(8, 0, 2048), (8, 4096, 512)]


def _time_decode(case: Case, settings: dict[str, Any]) -> dict[str, Any] | None:
    batch, context = case.batch, case.context
    for name, value in settings.items():
        setattr(da, name, value)
    try:
        us = time_us(case.ours, iters=10)
    except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:
        print(f"skip {settings}: {exc}", flush=True)
        return None
    return {
        "kind": "decode",
        "batch": batch,
        "context": context,
        **settings,
        "us": us,
        "gbps": case.kv_bytes() / us / 1e3,
    }


def sweep_decode(quick: bool) -> list[dict[str, Any]]:
    """Programs per multiprocessor the splits aim for, tiles and split limits."""
    rows = []
    defaults = {name: getattr(da, name) for name in dir(da) if name.startswith("DECODE_")}
    grid = itertools.product(
        (3, 4, 6, 8),
        ((64, 4, 2), (64, 2, 2), (32, 4, 2), (128, 4, 2)),
        (128, 256),
    )
    settings_list = [
        {"DECODE_PROGRAMS_PER_SM": per_sm, "DECODE_TILE": tile, "DECODE_MAX_SPLITS": max_splits}
        for per_sm, tile, max_splits in grid
    ]
    if quick:
        settings_list = settings_list[:2]
    for batch, context in DECODE_SHAPES:
        case = Case(batch, context, 1)
        for settings in settings_list:
            row = _time_decode(case, settings)
            rows += [row] if row else []
        del case
        torch.cuda.empty_cache()
    for name, value in defaults.items():
        setattr(da, name, value)
    for batch, context in DECODE_SHAPES:
        best = min(
            (r for r in rows if (r["batch"], r["context"]) == (batch, context)),
            key=lambda r: r["us"],
        )
        print("best decode", json.dumps(best), flush=True)
    return rows


def sweep_prefill(quick: bool) -> list[dict[str, Any]]:
    rows = []
    tiles = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2)]
    if quick:
        tiles = tiles[:1]
    for batch, context, new_tokens in PREFILL_SHAPES:
        case = Case(batch, context, new_tokens)
        for tile in tiles:
            pa.PREFILL_TILE = tile
            try:
                us = time_us(case.ours, iters=10)
            except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:
                print(f"skip {tile}: {exc}", flush=True)
                continue
            rows.append(
                {
                    "kind": "prefill",
                    "batch": batch,
                    "context": context,
                    "new_tokens": new_tokens,
                    "tile": list(tile),
                    "us": us,
                    "tflops": case.flops() / us / 1e6,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.kernels.tune")
    parser.add_argument("--output", default="kernels-tune.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("decode", "prefill"))
    args = parser.parse_args(argv)
    rows = []
    if args.only != "prefill":
        rows += sweep_decode(args.quick)
    if args.only != "decode":
        rows += sweep_prefill(args.quick)
    header = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    Path(args.output).write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
