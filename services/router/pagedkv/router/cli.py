"""Registers ``pagedkv router`` (imports nothing heavy until it runs)."""

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
)
from pagedkv.common.model_source import ModelNotFound, resolve_model


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """The routing options, shared by ``pagedkv router`` and ``pagedkv serve --routers``."""
    group = parser.add_argument_group("routing (see docs/routing.md)")
    group.add_argument(
        "--policy",
        default="kv",
        choices=("kv", "round-robin", "least-loaded"),
        help="kv: cached prefix weighed against load; the others ignore the cache",
    )
    group.add_argument(
        "--weight-prefix", type=float, default=1.0, help="kv: weight of the cached share"
    )
    group.add_argument(
        "--weight-load", type=float, default=0.5, help="kv: weight of queued / (mean + 1)"
    )
    group.add_argument(
        "--load-bound",
        type=float,
        default=1.5,
        help="kv: an executor that would pass this many times the mean queued (and the mean "
        "plus --load-slack) is ranked last",
    )
    group.add_argument(
        "--load-slack",
        type=float,
        default=4.0,
        help="kv: sequences above the mean any executor may run (the bound for small loads)",
    )
    group.add_argument("--weight-kv", type=float, default=0.5, help="kv: weight of KV usage")
    group.add_argument(
        "--weight-host",
        type=float,
        default=0.89,
        help="kv: a block in an executor's host tier, as a share of a cached block on its GPU",
    )


def register_router(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="route requests across a cluster by cached prefix and load (the Scheduler API)",
        description=(
            "Serves the Scheduler gRPC API in front of a cluster's schedulers: each request "
            "goes to the scheduler holding the executor whose prefix cache holds most of its "
            "prompt, weighed against load, with that executor as a placement hint. Reads "
            "everything from the cluster's Redis; prints one readiness line with its address."
        ),
    )
    parser.add_argument(
        "--redis-url", required=True, metavar="URL", help="redis://HOST:PORT/DB of the cluster"
    )
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
        help="serve Prometheus metrics on this port, on --host (default: none, no metrics)",
    )
    parser.add_argument(
        "--model",
        help="model directory, or a hub id in the local Hugging Face cache, for the tokenizer "
        "(default: the executors' model id)",
    )
    parser.add_argument(
        "--refresh-interval",
        type=float,
        default=0.1,
        help="seconds between reads of the registry, leases and load reports",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds open streams get to finish (then they end with UNAVAILABLE "
        "and clients resume them elsewhere)",
    )
    add_routing_arguments(parser)
    add_redis_secret_arguments(parser)
    add_server_tls_arguments(parser, clients="clients (the SDK)")
    add_auth_token_argument(parser)
    add_client_tls_arguments(parser, "scheduler-", "schedulers")
    parser.add_argument(
        "--scheduler-token-file",
        metavar="PATH",
        help="bearer token the router presents to schedulers (the file's first; re-read when "
        "it changes); without it, each call's own authorization is forwarded",
    )
    parser.set_defaults(handler=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    if args.model is not None:
        try:
            resolve_model(args.model)
        except ModelNotFound as exc:
            print(f"pagedkv router: --model {args.model}: {exc}", file=sys.stderr)
            return 2
    from pagedkv.router.server import run_router

    return run_router(args)
