"""Registers ``pagedkv bench blocks`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.common.cli import requires


def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="block-core benchmark: a ShareGPT-like trace through the executor's scheduler",
        description=(
            "Runs a synthetic ShareGPT-like trace through the service's ExecutorScheduler "
            "(its policy over the block core, answered by a simulated executor) and reports "
            "the scheduler's cost per step, prefix hits and block use."
        ),
    )
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--num-blocks", type=int, default=20_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat", type=int, default=3, help="trace runs; the fastest is reported (default 3)"
    )
    parser.add_argument(
        "--output", help="write the results as JSON to this file (default: none, printed only)"
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pagedkv.bench.scheduler.blocks import main

    return main(args)


@requires("pagedkv.executor")  # it starts executors
def register_scheduler_bench(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="the scheduler service over real executors: tokens/s, CPU and RPC cost per step",
    )
    add_scheduler_bench_arguments(parser)
    parser.set_defaults(handler=_run_scheduler_bench)


def _run_scheduler_bench(args: argparse.Namespace) -> int:
    from pagedkv.bench.scheduler.service import main

    return main(args)


def add_scheduler_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: a tiny llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--executors", type=int, default=1)
    parser.add_argument(
        "--num-blocks", type=int, help="KV blocks per executor (default: as the executor sizes it)"
    )
    parser.add_argument(
        "--kernel-backend",
        choices=("triton", "torch"),
        help="the executors' attention kernels (default: the executor's)",
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument(
        "--enforce-eager", action="store_true", help="executors without CUDA graphs"
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--executor-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output", help="write the results as JSON to this file (default: none, printed only)"
    )


@requires("pagedkv.executor")  # it starts executors
def register_cluster_bench(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="the Redis control plane on the CPU stack: a failover timeline and its cost",
        description=(
            "Starts a private redis-server and 3 CPU executors; kills one of 2 schedulers "
            "under an SDK load (failover timeline: requests/s, prefix hit rate, ownership), "
            "then compares the scheduler's CPU per step with and without Redis."
        ),
    )
    parser.add_argument("--model", help="model directory (default: a tiny llama)")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks per executor")
    parser.add_argument("--lease-ttl", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=16, help="SDK streams at once")
    parser.add_argument("--duration", type=float, default=30.0, help="timeline seconds")
    parser.add_argument("--kill-at", type=float, default=12.0, help="seconds into the timeline")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per request")
    parser.add_argument("--requests", type=int, default=96, help="requests of a cost run")
    parser.add_argument("--cost-tokens", type=int, default=128, help="new tokens per cost request")
    parser.add_argument("--repeat", type=int, default=3, help="cost runs of each kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        help="write JSON here (and .md and .png beside it) (default: none, printed only)",
    )
    parser.set_defaults(handler=_run_cluster_bench)


def _run_cluster_bench(args: argparse.Namespace) -> int:
    from pagedkv.bench.scheduler.cluster import main

    return main(args)


def register_host_tier_bench(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="prefix hits with and without a host tier, on a trace larger than the GPU pool",
        description=(
            "Runs a trace of long shared prefixes, whose distinct prefixes need several times "
            "the GPU pool, through the service's ExecutorScheduler (a simulated executor "
            "answers) with the GPU pool alone and with a host tier; reports hit rates and "
            "prefill tokens computed."
        ),
    )
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--num-prefixes", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=1025, help="GPU blocks, the null one too")
    parser.add_argument("--host-blocks", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output", help="write the results as JSON and markdown (default: none, printed only)"
    )
    parser.set_defaults(handler=_run_host_tier_bench)


def _run_host_tier_bench(args: argparse.Namespace) -> int:
    from pagedkv.bench.scheduler.host_tier import main

    return main(args)


@requires("pagedkv.executor")  # it starts executors
def register_swap_bench(subparsers: Any, name: str) -> None:
    from pagedkv.bench.scheduler.serving.cli import PRESETS

    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="swap versus recompute: the memory benchmark's chat on a halved GPU pool, per "
        "--host-loads mode",
        description=(
            "Sends the memory benchmark's chat requests at once to a GPU pool of "
            "--pool-fraction of the blocks they need, so that requests are preempted, once "
            "per mode, each on a fresh `pagedkv serve`: off (no host tier: recompute), and "
            "with a host tier holding every block, --host-loads never, always and auto. "
            "Reports throughput, TTFT, preemptions, the host tier's loads and the tokens "
            "computed, and whether auto matches the better of always and off."
        ),
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto"
    )
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="tiny (the memory benchmark's random llama), or a llama shape with dummy weights",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        help="chat requests (default: the memory benchmark's --chat-requests)",
    )
    parser.add_argument(
        "--pool-fraction",
        type=float,
        default=0.5,
        help="the GPU pool, of the blocks the requests need at their final lengths",
    )
    parser.add_argument(
        "--output-fraction",
        type=float,
        help="each request's share of its length generated (default: the memory "
        "benchmark's chat); more output grows the running requests and preempts more",
    )
    parser.add_argument(
        "--modes", default="off,never,always,auto", help="which to run (comma-separated)"
    )
    parser.add_argument(
        "--host-kv-gib",
        type=float,
        help="the host tier (default: room for every block of the requests)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every mode, each on a fresh server; each mode's fastest is reported",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output", help="write JSON here and markdown beside it (default: none, printed only)"
    )
    parser.set_defaults(handler=_run_swap_bench)


def _run_swap_bench(args: argparse.Namespace) -> int:
    from pagedkv.bench.scheduler.swap import main

    return main(args)
