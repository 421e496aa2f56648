"""Registers ``pagedkv bench routing`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.common.cli import requires


@requires("pagedkv.executor")  # it starts executors
def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="routing policies side by side on a local CPU cluster (prefill tokens, TTFT)",
        description=(
            "For each policy, starts a fresh local cluster (pagedkv serve --redis: CPU "
            "executors on a tiny random llama, schedulers, one router with that policy) and "
            "sends it the same seeded shared-prefix trace; compares prefill tokens computed, "
            "prefix hit rate, TTFT, throughput and the spread over executors."
        ),
    )
    cluster = parser.add_argument_group("cluster (one per policy)")
    cluster.add_argument("--model", help="model directory (default: a tiny random llama)")
    cluster.add_argument("--executors", type=int, default=4)
    cluster.add_argument("--schedulers", type=int, default=2)
    cluster.add_argument(
        "--num-blocks",
        type=int,
        default=1024,
        help="KV blocks per executor (default 1024: every prefix fits on every executor)",
    )
    cluster.add_argument("--max-num-seqs", type=int, default=64)
    cluster.add_argument(
        "--weights",
        default="",
        metavar="PREFIX,LOAD,KV[,BOUND[,SLACK]]",
        help="the kv policy's weights, load bound and slack (default: the router's)",
    )
    trace = parser.add_argument_group("trace")
    trace.add_argument("--num-requests", type=int, default=256)
    trace.add_argument("--concurrency", type=int, default=16, help="streams at once")
    trace.add_argument("--num-prefixes", type=int, default=16)
    trace.add_argument("--prefix-len", type=int, default=512)
    trace.add_argument("--min-suffix-len", type=int, default=8)
    trace.add_argument("--max-suffix-len", type=int, default=128)
    trace.add_argument(
        "--output-lens", default="8,16,32,64", help="max_tokens choices, comma-separated"
    )
    trace.add_argument(
        "--zipf", type=float, default=1.0, help="prefix popularity exponent (0: uniform)"
    )
    trace.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies", default="kv,round-robin,least-loaded", help="comma-separated policies"
    )
    parser.add_argument(
        "--output",
        help="write JSON here (and .md and .png beside it) (default: none, printed only)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pagedkv.bench.routing.routing import main

    return main(args)
