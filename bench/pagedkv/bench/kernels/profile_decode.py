"""One attention call of `pagedkv bench kernels`' cases, repeated, for a
profiler to read (Nsight Compute: ``tests/gpu/run-fp8-bench.sh ncu``)::

    python -m pagedkv.bench.kernels.profile_decode fp8_e4m3 32x8192 --head-size 128
    python -m pagedkv.bench.kernels.profile_decode bfloat16 8x0 --new-tokens 2048
    python -m pagedkv.bench.kernels.profile_decode bfloat16 8x0 --new-tokens 2048 --gluon
    python -m pagedkv.bench.kernels.profile_decode bfloat16 8x0 --new-tokens 2048 \
        --gluon-tiling 64x4x5x128

It builds the case (paged K/V behind shuffled block tables, quantized as
the bench quantizes them), calls the kernel ``--calls`` times (the first
compiles it) and synchronizes; it measures nothing itself.
"""

from __future__ import annotations

import argparse

import torch

from pagedkv.bench.kernels.bench import DTYPE, HEAD_SIZE, Case
from pagedkv.bench.kernels.tune import gluon_tilings
from pagedkv.kernels import fp8_kv, int8_kv, paged_attention, prefill_gluon


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    formats = {"bfloat16": DTYPE, **fp8_kv.KV_CACHE_DTYPES, **int8_kv.KV_CACHE_DTYPES}
    parser.add_argument("kv_cache_dtype", choices=formats)
    parser.add_argument("shape", help="BATCHxCONTEXT: sequences and the tokens each has cached")
    parser.add_argument("--head-size", type=int, default=HEAD_SIZE)
    parser.add_argument(
        "--new-tokens", type=int, default=1, help="a sequence's new tokens (1: a decode)"
    )
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument(
        "--gluon", action="store_true", help="a prefill takes the Gluon kernel (PREFILL_GLUON)"
    )
    parser.add_argument(
        "--gluon-tiling",
        type=gluon_tilings,
        help="KEYSxBUFFERSxSCHEDULExROWS: the Gluon prefill's tiling at every head size "
        "(prefill_gluon.TILING; implies --gluon)",
    )
    args = parser.parse_args(argv)
    paged_attention.PREFILL_GLUON = args.gluon or args.gluon_tiling is not None
    if args.gluon_tiling is not None:
        if len(args.gluon_tiling) != 1:
            parser.error("--gluon-tiling: one tiling")
        prefill_gluon.TILING = dict.fromkeys(prefill_gluon.TILING, args.gluon_tiling[0])
    try:
        batch, context = (int(part) for part in args.shape.lower().split("x"))
    except ValueError:
        parser.error(f"shape: expected BATCHxCONTEXT, got {args.shape!r}")
    if args.new_tokens < 1:
        parser.error("--new-tokens: at least 1")
    case = Case(batch, context, args.new_tokens, args.head_size, formats[args.kv_cache_dtype])
    for _ in range(args.calls):
        case.ours()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
