"""Registers ``pagedkv scheduler`` and ``pagedkv serve`` (imports nothing
heavy until they run)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedkv.common.cli import (
    DEFAULT_SCHEDULER_PORT,
    add_auth_token_argument,
    add_client_tls_arguments,
    add_redis_secret_arguments,
    add_server_tls_arguments,
    requires,
)
from pagedkv.common.model_source import ModelNotFound, resolve_model
from pagedkv.common.step_contract import (
    DEFAULT_DECODE_WINDOW,
    DEFAULT_PIPELINE_DEPTH,
    MAX_DECODE_STEPS,
    ONE_STEP,
    SINGLE_STEP_PIPELINE_DEPTH,
)
from pagedkv.scheduler.host_tier import HOST_LOADS, HOST_OFFLOADS

MAX_PIPELINE_DEPTH = 8


def _int_in(low: int, high: int) -> Any:
    """An argparse type: an integer from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    return parse


def _scheduler_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_SCHEDULER_PORT,
        help="0: any free port (printed); clients take this port for a target without one",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port, on --host (default: no metrics endpoint)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="running sequences")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per step")
    parser.add_argument(
        "--decode-window",
        type=_int_in(ONE_STEP, MAX_DECODE_STEPS),
        default=DEFAULT_DECODE_WINDOW,
        help="most decode steps one step message asks an executor for, when every running "
        f"request is a plain decode and none waits (default {DEFAULT_DECODE_WINDOW}; 1: one "
        f"step a message; at most {MAX_DECODE_STEPS})",
    )
    parser.add_argument(
        "--pipeline-depth",
        type=_int_in(1, MAX_PIPELINE_DEPTH),
        help="steps in flight per executor: the next ones are scheduled and sent while the "
        f"executor runs the first (1: none ahead; default {DEFAULT_PIPELINE_DEPTH}, "
        f"{SINGLE_STEP_PIPELINE_DEPTH} with --decode-window 1)",
    )
    parser.add_argument(
        "--host-loads",
        choices=HOST_LOADS,
        default="auto",
        help="with executors that have a host KV tier: whether a request loads the blocks of "
        "its prefix found there (auto: when the executor's measured load cost is below the "
        "prefill of their tokens; always; never: recompute them); see docs/memory.md",
    )
    parser.add_argument(
        "--host-offload",
        choices=HOST_OFFLOADS,
        default="eviction",
        help="with a host KV tier: when a cached block is copied there (write-through: in the "
        "step after the one that computed it; eviction: only when the GPU pool evicts it); "
        "see docs/memory.md",
    )
    parser.add_argument(
        "--host-idle-offload-blocks",
        type=_int_in(0, 1 << 30),
        default=0,
        help="with a host KV tier: while an executor has nothing to do, the cached blocks among "
        "the next N its GPU pool hands out are offloaded ahead of their eviction, so the step "
        "that evicts them copies nothing (default 0: off); see docs/memory.md",
    )
    parser.add_argument(
        "--stream-pace-us",
        type=float,
        default=150.0,
        help="a Generate stream's pause after each message, microseconds per open stream "
        "(at most 50 ms; 0: a message every step): fewer, larger messages under load",
    )
    parser.add_argument(
        "--executor-timeout", type=float, default=120.0, help="seconds before a step fails"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests get to finish before they end with "
        "UNAVAILABLE (clients resume them on another replica)",
    )
    cluster = parser.add_argument_group("cluster (with Redis)")
    cluster.add_argument(
        "--redis-url",
        metavar="URL",
        help="redis://HOST:PORT/DB of the cluster's control plane: executors are found in its "
        "registry and held through leases (see docs/cluster.md); without it, no cluster",
    )
    cluster.add_argument(
        "--lease-ttl", type=float, default=3.0, help="seconds a lease on an executor lasts"
    )
    cluster.add_argument(
        "--advertise-address",
        metavar="HOST:PORT",
        help="the address other members see for this scheduler (default: --host and the port)",
    )


def register_scheduler(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="schedule requests over running executors (the Scheduler gRPC API)",
        description=(
            "Takes over the given executors (or, with --redis-url, its share of the "
            "cluster's) and serves the Scheduler API. Prints one readiness line with its "
            "address."
        ),
    )
    parser.add_argument(
        "--executor",
        action="append",
        default=[],
        metavar="HOST:PORT",
        dest="executors",
        help="a running executor (repeat for each); not with --redis-url (default: none, "
        "then --redis-url finds them)",
    )
    parser.add_argument(
        "--model",
        help="model directory, or a hub id in the local Hugging Face cache, for the tokenizer "
        "(default: the executors' model id)",
    )
    _scheduler_args(parser)
    add_redis_secret_arguments(parser)
    add_server_tls_arguments(parser, clients="clients (routers, the SDK)")
    add_auth_token_argument(parser)
    add_client_tls_arguments(parser, "executor-", "executors")
    parser.set_defaults(handler=_run_scheduler)


@requires("pagedkv.executor")  # it starts executors
def register_serve(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="start executors and a scheduler in one command",
        description=(
            "Starts K executor processes on a model (a tiny random one made in a temporary "
            "directory when neither MODEL nor --model is given) and a scheduler over them. "
            "With --redis-url URL or --redis, they form a cluster of --schedulers N "
            "schedulers and --routers R routers (see docs/cluster.md); with --http-port, a "
            "gateway serves the OpenAI HTTP API in front of them (docs/http.md). Prints one "
            "ready line per scheduler, per router and for the gateway. The first SIGTERM or "
            "SIGINT stops every child cleanly, a second one forces the stop; the children die "
            "with this process."
        ),
    )
    parser.add_argument(
        "model_path",
        nargs="?",
        metavar="MODEL",
        help="model directory, or a hub id already in the local cache (like --model)",
    )
    parser.add_argument(
        "--model",
        help="model directory, or a hub id already in the local cache (default: a tiny random "
        "llama made in a temporary directory)",
    )
    parser.add_argument("--executors", type=int, default=1, help="executor processes, K (>= 1)")
    parser.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="schedulers, N: one in this process and N-1 child processes on --port+1.. "
        "(any free port when --port is 0); over 1 needs --redis-url or --redis",
    )
    parser.add_argument(
        "--routers",
        type=int,
        default=0,
        help="routers, R (`pagedkv router` child processes, docs/routing.md) on --port.. "
        "(the schedulers' ports then follow theirs); needs --redis-url or --redis",
    )
    parser.add_argument(
        "--router-policy",
        default="kv",
        choices=("kv", "round-robin", "least-loaded"),
        help="the routers' --policy",
    )
    parser.add_argument(
        "--router-weights",
        metavar="PREFIX,LOAD,KV[,BOUND[,SLACK]]",
        help="the routers' --weight-prefix, --weight-load, --weight-kv, --load-bound and "
        "--load-slack (default: theirs)",
    )
    parser.add_argument(
        "--redis",
        action="store_true",
        help="start a private redis-server (from PATH, no persistence) on a free port for the "
        "cluster, stopped on exit, requiring a generated password (in a file only this user "
        "reads, given to the children as --redis-password-file); not with --redis-url",
    )
    parser.add_argument("--device", default="cpu", help="executors' device (cuda: one GPU each)")
    parser.add_argument(
        "--num-blocks",
        type=int,
        help="KV blocks per executor (default: 2048 on the CPU; on a GPU, what "
        "--gpu-memory-utilization leaves for the KV cache)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="the executors' fraction of their GPU for weights, activations and KV, in (0, 1] "
        "(default: theirs, 0.9); not with --num-blocks",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the executors' longest sequence, prompt and output (default: the model's positions)",
    )
    parser.add_argument(
        "--host-kv-gib",
        type=float,
        help="each executor's host-memory KV tier, in GiB (default: none); see docs/memory.md",
    )
    parser.add_argument(
        "--kernel-backend",
        choices=("triton", "torch"),
        help="attention kernels (default: torch on cpu, triton on cuda)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="auto: the model's (float32 on cpu)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"),
        help="the executors' KV block dtype (default: theirs, auto: the model's); fp8 halves a "
        "bf16 block, int8 nearly (a scale per token beside it; docs/memory.md)",
    )
    parser.add_argument(
        "--kv-cache-rotation",
        choices=("auto", "none", "hadamard"),
        help="the executors' KV rotation (default: theirs, auto: Hadamard for fp8 and int8 "
        "blocks where the model allows it; docs/memory.md)",
    )
    parser.add_argument(
        "--load-format", default="auto", choices=("auto", "dummy"), help="dummy: random weights"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="executors without CUDA graphs"
    )
    parser.add_argument(
        "--cuda-graphs",
        default="all",
        choices=("all", "decode"),
        help="the executors' steps replayed from CUDA graphs: all, or decode steps only",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        metavar="PORT",
        help="also start a gateway (`pagedkv gateway`, a child process) serving the OpenAI "
        "HTTP API on this port of --host, in front of the routers (else the schedulers); "
        "0: any free port (default: none, no HTTP API; see docs/http.md)",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME[,NAME...]",
        help="with --http-port: the model names requests give (default: the model as given)",
    )
    _scheduler_args(parser)
    add_redis_secret_arguments(parser)
    add_server_tls_arguments(
        parser,
        clients="clients (of every scheduler and router here; the executors listen on "
        "127.0.0.1 only)",
    )
    add_auth_token_argument(parser)
    add_client_tls_arguments(parser, "scheduler-", "schedulers (the routers' own)")
    parser.set_defaults(handler=_run_serve)


def _run_scheduler(args: argparse.Namespace) -> int:
    if args.model is not None:
        try:
            resolve_model(args.model)
        except ModelNotFound as exc:
            print(f"pagedkv scheduler: --model {args.model}: {exc}", file=sys.stderr)
            return 2
    from pagedkv.scheduler.server import run_scheduler

    return run_scheduler(args)


def _run_serve(args: argparse.Namespace) -> int:
    from pagedkv.scheduler.serve import run_serve

    return run_serve(args)
