"""Registers ``pagedkv bench cluster-sim`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="discrete-event simulation of a routed cluster over the real scheduler",
        description=(
            "Simulates executors (each scheduled by the service's ExecutorScheduler) owned "
            "by schedulers "
            "behind one router, with a step cost calibrated on the committed H200 results; "
            "compares the routing policies on a shared-prefix trace and fails a scheduler."
        ),
    )
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--executors", type=int, default=64)
    cluster.add_argument("--schedulers", type=int, default=8)
    cluster.add_argument(
        "--num-blocks", type=int, default=8192, help="KV blocks per executor (default 8192)"
    )
    cluster.add_argument("--block-size", type=int, default=16)
    cluster.add_argument("--max-num-seqs", type=int, default=64)
    cluster.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cluster.add_argument("--flush-interval", type=float, default=0.05, help="seconds")
    cluster.add_argument("--index-lag", type=float, default=0.0, help="seconds after a flush")
    cluster.add_argument("--report-interval", type=float, default=0.1, help="seconds")
    cluster.add_argument("--lease-ttl", type=float, default=3.0, help="seconds")
    trace = parser.add_argument_group("trace")
    trace.add_argument(
        "--rate-per-executor", type=float, default=40.0, help="arrivals/s per executor"
    )
    trace.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    trace.add_argument("--num-prefixes", type=int, default=48)
    trace.add_argument("--min-prefix-len", type=int, default=512)
    trace.add_argument("--max-prefix-len", type=int, default=2048)
    trace.add_argument("--zipf", type=float, default=1.0, help="prefix popularity exponent")
    trace.add_argument("--mean-suffix-len", type=float, default=192.0)
    trace.add_argument("--mean-output-len", type=float, default=160.0)
    trace.add_argument("--seed", type=int, default=0)
    runs = parser.add_argument_group("runs")
    runs.add_argument(
        "--policies", default="kv,round-robin,least-loaded", help="comma-separated policies"
    )
    for weight in ("weight-prefix", "weight-load", "weight-kv", "load-bound", "load-slack"):
        runs.add_argument(
            f"--{weight}",
            type=float,
            help=f"the kv policy's {weight.replace('-', ' ')} (default: the router's)",
        )
    runs.add_argument(
        "--fail-at", type=float, default=None, help="seconds (default: half the duration)"
    )
    runs.add_argument(
        "--failure-policies", default="kv", help="policies also run with a scheduler failure"
    )
    runs.add_argument("--no-failure", action="store_true", help="no failure runs")
    runs.add_argument(
        "--quick", action="store_true", help="8 executors x 2 schedulers, 10 s of arrivals"
    )
    runs.add_argument("--jobs", type=int, default=None, help="runs at once (default: cores)")
    parser.add_argument(
        "--output",
        help="write JSON here (and .md and .png beside it) (default: none, printed only)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pagedkv.bench.cluster_sim.bench import main

    return main(args)
