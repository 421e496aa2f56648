"""``python -m pagedkv.bench.kernels.tune``: sweeps the launch constants of
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

from pagedkv.bench.kernels.bench import DTYPE, HEAD_SIZE, Case, time_us
from pagedkv.kernels import decode_attention as da
from pagedkv.kernels import fp8_kv, int8_kv, prefill_gluon
from pagedkv.kernels import paged_attention as pa

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
        us = time_us(case.ours, iters=20)
    except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:
        print(f"skip {settings}: {exc}", flush=True)
        return None
    return {
        "kind": "decode",
        "batch": batch,
        "context": context,
        "head_size": case.head_size,
        **settings,
        "us": us,
        "gbps": case.kv_bytes() / us / 1e3,
    }


# With --decode-shapes: a wider grid at fewer shapes (programs per
# multiprocessor, tiles with deeper pipelines, steps a split takes at least).
WIDE_TILES = ((64, 4, 2), (64, 4, 3), (64, 2, 2), (64, 2, 3), (32, 4, 2), (32, 2, 3), (128, 4, 2))


# An fp8 cache's grid: its own constants (DECODE_FP8_*), V tiles widened
# before the dot's layout or not, and tiles of more warps (an fp8 program
# holds more registers).
FP8_TILES = ((64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (32, 4, 2), (32, 4, 3), (128, 8, 2))


def decode_settings(
    wide: bool, fp8: bool = False, switch: str | None = None, per_sm: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """The decode constants to try: the default grid, the wide one, an fp8
    cache's, or (``switch``) one boolean constant off then on, the rest as
    they are or, with ``per_sm``, at each of those programs per
    multiprocessor (the cache's DECODE_FP8_ or DECODE_PROGRAMS_PER_SM)."""
    # A quantized cache's programs per multiprocessor: its bytes' and its
    # words' (DECODE_WORDS_PROGRAMS_PER_SM), set alike.
    names: tuple[str, ...] = ("DECODE_FP8_PROGRAMS_PER_SM", "DECODE_WORDS_PROGRAMS_PER_SM")
    if not fp8:
        names = ("DECODE_PROGRAMS_PER_SM",)
    if switch:
        if per_sm:
            return [{switch: on, **dict.fromkeys(names, n)} for on in (False, True) for n in per_sm]
        return [{switch: False}, {switch: True}]
    if fp8:
        return [
            {
                **dict.fromkeys(names, per_sm),
                "DECODE_FP8_TILE": tile,
                "DECODE_FP8_WIDEN_V": widen,
            }
            for per_sm, tile, widen in itertools.product((2, 3, 4, 6, 8), FP8_TILES, (False, True))
        ]
    if wide:
        return [
            {
                "DECODE_PROGRAMS_PER_SM": per_sm,
                "DECODE_TILE": tile,
                "DECODE_MIN_STEPS_PER_SPLIT": min_steps,
            }
            for per_sm, tile, min_steps in itertools.product(
                (2, 3, 4, 6, 8, 12, 16), WIDE_TILES, (1, 2)
            )
        ]
    grid = itertools.product(
        (3, 4, 6, 8),
        ((64, 4, 2), (64, 2, 2), (32, 4, 2), (128, 4, 2)),
        (128, 256),
    )
    return [
        {"DECODE_PROGRAMS_PER_SM": per_sm, "DECODE_TILE": tile, "DECODE_MAX_SPLITS": max_splits}
        for per_sm, tile, max_splits in grid
    ]


def sweep_decode(
    quick: bool,
    shapes: list[tuple[int, int]] | None = None,
    head_size: int = HEAD_SIZE,
    kv_dtype: torch.dtype = DTYPE,
    switch: str | None = None,
    per_sm: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Programs per multiprocessor the splits aim for, tiles and split limits,
    at the benchmark's shapes or at ``shapes`` (batch, context) with the wide
    grid; over an fp8 cache (``kv_dtype``), its own grid; with ``switch``,
    that boolean constant off and on, at each of ``per_sm`` programs per
    multiprocessor when given (``decode_settings``)."""
    rows = []
    defaults = {name: getattr(da, name) for name in dir(da) if name.startswith("DECODE_")}
    settings_list = decode_settings(shapes is not None, kv_dtype != DTYPE, switch, per_sm)
    if quick:
        settings_list = settings_list[:2]
    shapes = shapes or DECODE_SHAPES
    for batch, context in shapes:
        case = Case(batch, context, 1, head_size, kv_dtype)
        for settings in settings_list:
            row = _time_decode(case, settings)
            rows += [row] if row else []
        del case
        torch.cuda.empty_cache()
    for name, value in defaults.items():
        setattr(da, name, value)
    for batch, context in shapes:
        best = min(
            (r for r in rows if (r["batch"], r["context"]) == (batch, context)),
            key=lambda r: r["us"],
        )
        print("best decode", json.dumps(best), flush=True)
    return rows


# The default prefill grid: the bf16 and quantized defaults and their
# nearest rivals in the sweeps (kernels-prefill-tune-*).
PREFILL_TILES: tuple[tuple[int, ...], ...] = (
    (128, 32, 8, 3, 128),
    (128, 32, 8, 4, 128),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
)


def prefill_settings(
    tiles: tuple[tuple[int, ...], ...] | None = None,
    switches: tuple[str, ...] = (),
    tile_name: str = "PREFILL_TILE",
) -> list[dict[str, Any]]:
    """The prefill constants to try: each tile (``tile_name``, a quantized
    cache's ``PREFILL_QUANTIZED_TILE``: query rows, keys a step, warps,
    stages) with every combination of the boolean ``switches``
    (``PREFILL_*`` constants of ``paged_attention``) off and on."""
    for name in switches:
        if not name.startswith("PREFILL_") or not isinstance(getattr(pa, name, None), bool):
            raise ValueError(f"prefill switches: {name} is not a boolean PREFILL_ constant")
    return [
        {tile_name: tile, **dict(zip(switches, values, strict=True))}
        for tile in tiles or PREFILL_TILES
        for values in itertools.product((False, True), repeat=len(switches))
    ]


GLUON_TILING = "gluon_tiling"


def sweep_prefill(
    quick: bool,
    tiles: tuple[tuple[int, ...], ...] | None = None,
    switches: tuple[str, ...] = (),
    kv_dtype: torch.dtype = DTYPE,
    gluon_tilings: tuple[tuple[int, ...], ...] = (),
    head_size: int = HEAD_SIZE,
) -> list[dict[str, Any]]:
    """The prefill kernel at the benchmark's prefill shapes (``head_size``)
    under each of ``prefill_settings``, then the Gluon prefill
    (``PREFILL_GLUON``) at each of ``gluon_tilings``
    (``prefill_gluon.TILING``'s), with the best SDPA backend's time at each
    shape (``ratio_vs_sdpa``: ours over it)."""
    rows = []
    defaults = {name: getattr(pa, name) for name in dir(pa) if name.startswith("PREFILL_")}
    tile_name = "PREFILL_TILE" if kv_dtype == DTYPE else "PREFILL_QUANTIZED_TILE"
    # The Triton kernel's rows take it, not the Gluon prefill.
    settings_list = [
        {**settings, "PREFILL_GLUON": False}
        for settings in prefill_settings(tiles, switches, tile_name)
    ]
    if quick:
        settings_list = settings_list[:1]
    # The Gluon prefill at each of its tilings (prefill_gluon.TILING's).
    settings_list += [{"PREFILL_GLUON": True, GLUON_TILING: tiling} for tiling in gluon_tilings]
    gluon_default = dict(prefill_gluon.TILING)
    for batch, context, new_tokens in PREFILL_SHAPES:
        case = Case(batch, context, new_tokens, head_size, kv_dtype)
        sdpa_us, backend = case.best_sdpa_us()
        for settings in settings_list:
            for name, value in settings.items():
                if name == GLUON_TILING:
                    prefill_gluon.TILING = dict.fromkeys(gluon_default, value)
                else:
                    setattr(pa, name, value)
            try:
                us = time_us(case.ours, iters=10)
            except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:
                print(f"skip {settings}: {exc}", flush=True)
                continue
            finally:
                for name, value in defaults.items():
                    setattr(pa, name, value)
                prefill_gluon.TILING = dict(gluon_default)
            rows.append(
                {
                    "kind": "prefill",
                    "batch": batch,
                    "context": context,
                    "new_tokens": new_tokens,
                    "head_size": head_size,
                    **{k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
                    "us": us,
                    "tflops": case.flops() / us / 1e6,
                    "sdpa_us": sdpa_us,
                    "sdpa_backend": backend,
                    "ratio_vs_sdpa": us / sdpa_us,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def best_overall(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode constants that come closest to each shape's best: the
    least worst ratio of their time to the shape's best time (every shape
    of ``rows`` measured under them)."""
    decode = [r for r in rows if r["kind"] == "decode"]
    shapes = {(r["batch"], r["context"]) for r in decode}
    fastest = {
        shape: min(r["us"] for r in decode if (r["batch"], r["context"]) == shape)
        for shape in shapes
    }
    worst: dict[str, float] = {}
    measured: dict[str, int] = {}
    for r in decode:
        key = json.dumps({k: v for k, v in r.items() if k.startswith("DECODE_")}, sort_keys=True)
        ratio = r["us"] / fastest[(r["batch"], r["context"])]
        worst[key] = max(worst.get(key, 0.0), ratio)
        measured[key] = measured.get(key, 0) + 1
    complete = [key for key in worst if measured[key] == len(shapes)]
    return dict(json.loads(min(complete, key=lambda key: worst[key])))


def apply_constants(constants: dict[str, Any]) -> dict[str, Any]:
    """Sets ``pagedkv.kernels.decode_attention``'s ``DECODE_*`` constants
    (JSON lists become tuples); returns every ``DECODE_*`` value now in force."""
    for name, value in constants.items():
        if not name.startswith("DECODE_") or not hasattr(da, name):
            raise ValueError(f"decode constants: no constant {name!r}")
        setattr(da, name, tuple(value) if isinstance(value, list) else value)
    return {name: getattr(da, name) for name in dir(da) if name.startswith("DECODE_")}


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"not BATCHxCONTEXT,...: {text!r}")
    return [(b, c) for b, c in shapes]


def _tiles(text: str) -> tuple[tuple[int, ...], ...]:
    try:
        tiles = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        tiles = []
    if not tiles or any(len(t) not in (4, 5) or min(t) < 1 for t in tiles):
        raise argparse.ArgumentTypeError(f"not MxNxWARPSxSTAGES[xREGISTERS],...: {text!r}")
    return tuple(tiles)


def gluon_tilings(text: str) -> tuple[tuple[int, ...], ...]:
    try:
        tilings = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        tilings = []
    if not tilings or any(
        len(t) != 4
        or t[0] < 16
        or t[2] not in range(9)
        or t[1] < {2: 4, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2}.get(t[2], 3)
        or t[3] not in ((128,) if t[2] >= 3 else (64, 128))
        for t in tilings
    ):
        raise argparse.ArgumentTypeError(
            f"not NxSTAGESxSCHEDULExROWS,... (N >= 16, SCHEDULE 0 to 8, STAGES >= 3, or 4 "
            f"with SCHEDULE 2, or 2 with 3 to 8, ROWS 64 or 128, 128 with SCHEDULE 3 to 8: "
            f"prefill_gluon.TILING): {text!r}"
        )
    return tuple(tilings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.kernels.tune")
    parser.add_argument("--output", default="kernels-tune.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("decode", "prefill"))
    parser.add_argument(
        "--decode-shapes",
        type=_shapes,
        help="BATCHxCONTEXT,...: sweep the wide decode grid at these shapes only",
    )
    parser.add_argument("--head-size", type=int, default=HEAD_SIZE)
    parser.add_argument(
        "--kv-cache-dtype",
        default="bfloat16",
        choices=("bfloat16", *fp8_kv.KV_CACHE_DTYPES, *int8_kv.KV_CACHE_DTYPES),
        help="the paged K/V's dtype (default bfloat16); fp8 and int8 sweep the DECODE_FP8_* "
        "constants (int8 shares them)",
    )
    parser.add_argument(
        "--switch",
        metavar="DECODE_NAME",
        help="time one boolean decode constant off then on (e.g. DECODE_PREFETCH), "
        "at the decode shapes, instead of a grid",
    )
    parser.add_argument(
        "--per-sm",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=(),
        metavar="N,...",
        help="with --switch: time it off and on at each of these programs per multiprocessor",
    )
    parser.add_argument(
        "--prefill-tiles",
        type=_tiles,
        metavar="MxNxWARPSxSTAGES[xREGISTERS],...",
        help="the prefill tiles to time (default: PREFILL_TILES); a fifth field caps a "
        "thread's registers",
    )
    parser.add_argument(
        "--prefill-switch",
        action="append",
        default=[],
        metavar="PREFILL_NAME",
        help="a boolean prefill constant timed off and on with each tile (repeatable)",
    )
    parser.add_argument(
        "--gluon-tilings",
        type=gluon_tilings,
        default=(),
        metavar="NxSTAGESxSCHEDULExROWS,...",
        help="also time the Gluon prefill (sm_90) at these tilings: keys a tile, ring buffers, "
        "schedule, query rows a program (prefill_gluon.TILING)",
    )
    parser.add_argument(
        "--best",
        metavar="FILE",
        help="print, as JSON, the decode constants of FILE (a sweep's output) "
        "closest to each shape's best, and exit",
    )
    args = parser.parse_args(argv)
    if args.best:
        print(json.dumps(best_overall(json.loads(Path(args.best).read_text())["rows"])))
        return 0
    rows = []
    if args.only != "prefill":
        formats = {**fp8_kv.KV_CACHE_DTYPES, **int8_kv.KV_CACHE_DTYPES}
        kv_dtype = formats.get(args.kv_cache_dtype, DTYPE)
        if args.switch and not isinstance(getattr(da, args.switch, None), bool):
            parser.error(f"--switch: {args.switch} is not a boolean DECODE_ constant")
        rows += sweep_decode(
            args.quick, args.decode_shapes, args.head_size, kv_dtype, args.switch, args.per_sm
        )
    if args.only != "decode":
        formats = {**fp8_kv.KV_CACHE_DTYPES, **int8_kv.KV_CACHE_DTYPES}
        try:
            rows += sweep_prefill(
                args.quick,
                args.prefill_tiles,
                tuple(args.prefill_switch),
                formats.get(args.kv_cache_dtype, DTYPE),
                args.gluon_tilings,
                args.head_size,
            )
        except ValueError as exc:
            parser.error(str(exc))
    header = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    Path(args.output).write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
