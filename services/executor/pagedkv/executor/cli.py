"""Registers ``pagedkv executor`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pagedkv.common.cli import (
    ModelArgumentError,
    add_redis_secret_arguments,
    add_server_tls_arguments,
    check_model_argument,
)


def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="serve a model over a paged KV cache (the Executor gRPC API)",
        description=(
            "Loads a Hugging Face decoder model on pagedkv attention, sizes its KV cache "
            "and serves the Executor API. Prints one readiness line with its address."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a model directory, or the id of a model in the local Hugging Face cache (nothing "
        "is downloaded)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="auto: the model's (float32 on cpu)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"),
        help="the KV blocks' dtype (default auto: the model's); fp8_e4m3 or fp8_e5m2 halve a "
        "bf16 block's bytes, with per-KV-head scales calibrated at start; int8 takes "
        "(head size + 2) / (2 head size) of them, with a scale per token written with it, "
        "and keeps more of the model's accuracy (docs/memory.md)",
    )
    parser.add_argument(
        "--kv-cache-rotation",
        default="auto",
        choices=("auto", "none", "hadamard"),
        help="store K and V in the Hadamard basis of the head size, which spreads fp8's and "
        "int8's rounding error over every channel at no read cost (default auto: for fp8 "
        "blocks when the model allows it and its checkpoint stores no KV scales, for int8 "
        "blocks when the model allows it; docs/memory.md)",
    )
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument(
        "--num-blocks",
        type=int,
        help="KV blocks, the null block included (default: sized by --gpu-memory-utilization)",
    )
    sizing.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the GPU for weights, activations and KV (default: 0.9)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--host-kv-gib",
        type=float,
        default=0.0,
        help="GiB of host memory for the host KV tier, whole blocks (pinned on CUDA), which "
        "steps offload blocks to and load them back from (default: 0, no host tier)",
    )
    parser.add_argument(
        "--kernel-backend", default="triton", choices=("triton", "torch"), help="attention kernels"
    )
    parser.add_argument(
        "--fused-ops",
        default="on",
        choices=("on", "off"),
        help="on: llama, qwen2 and mistral run on fused RMSNorm, rotary and SiLU kernels "
        "(other models, and off: transformers' modules)",
    )
    parser.add_argument(
        "--load-format", default="auto", choices=("auto", "dummy"), help="dummy: random weights"
    )
    parser.add_argument("--max-num-rows", type=int, default=256, help="live requests at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    parser.add_argument("--max-model-len", type=int, help="default: the model's positions")
    parser.add_argument(
        "--max-logprobs", type=int, default=20, help="top logprobs a request may ask for"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: launch every step's kernels one by one",
    )
    parser.add_argument(
        "--cuda-graphs",
        default="all",
        choices=("all", "decode"),
        help="steps replayed from CUDA graphs (without --enforce-eager): all: decode steps and "
        "steps of up to 1,024 tokens that compute prompts; decode: decode steps only",
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bars on stderr (pagedkv serve reports its executors' start-up itself)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics (the interpreter's lag) on this port, 0: any free one "
        "(default: none)",
    )
    parser.add_argument(
        "--redis-url",
        help="redis://HOST:PORT/DB: register in the cluster registry there and heartbeat "
        "(unregistered on SIGTERM/SIGINT); without it (default), the executor is on its own",
    )
    parser.add_argument(
        "--advertise-address",
        help="HOST:PORT schedulers reach this executor at, as registered (default: --host and "
        "the bound port; the machine's host name when --host is a wildcard)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the owner gets to finish this executor's requests (it moves "
        "the rest elsewhere) before the executor stops",
    )
    add_redis_secret_arguments(parser)
    add_server_tls_arguments(parser, clients="schedulers")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        check_model_argument(args.model)
    except ModelArgumentError as exc:
        print(f"pagedkv executor: --model {args.model}: {exc}", file=sys.stderr)
        return 2
    if not args.drain_timeout >= 0:
        print(
            f"pagedkv executor: --drain-timeout {args.drain_timeout}: must be >= 0", file=sys.stderr
        )
        return 2
    from pagedkv.common.security import SecurityError
    from pagedkv.common.server_security import server_security_from_args

    try:
        # An executor serving TLS accepts only the cluster CA's clients.
        args.security = server_security_from_args(args, require_ca=True)
    except SecurityError as exc:
        print(f"pagedkv executor: {exc}", file=sys.stderr)
        return 2
    if args.redis_url is not None:
        from pagedkv.cluster.connection import RedisUrlError, redis_url_with

        try:
            args.redis_url = redis_url_with(
                args.redis_url, password_file=args.redis_password_file, tls_ca=args.redis_tls_ca
            )
        except RedisUrlError as exc:
            print(f"pagedkv executor: {exc}", file=sys.stderr)
            return 2
    elif args.redis_password_file is not None or args.redis_tls_ca is not None:
        print(
            "pagedkv executor: --redis-password-file and --redis-tls-ca need --redis-url",
            file=sys.stderr,
        )
        return 2
    if args.advertise_address is not None:
        host, _, port = args.advertise_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            print(
                f"pagedkv executor: --advertise-address {args.advertise_address}: "
                "not HOST:PORT (e.g. executor-0.example:50061)",
                file=sys.stderr,
            )
            return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pagedkv.executor.server import serve

    return serve(args)
