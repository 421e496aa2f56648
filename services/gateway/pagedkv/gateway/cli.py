"""Registers ``pagedkv gateway`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.common.cli import add_auth_token_argument, add_client_tls_arguments

DEFAULT_HTTP_PORT = 8000
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pagedkv gateway`` but its targets and model."""
    parser.add_argument(
        "--served-model-name",
        metavar="NAME[,NAME...]",
        help="the model names requests give and /v1/models lists (default: --model as given)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port; 0: any free port (printed)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, seconds requests in flight get to finish (new connections are "
        "refused at once)",
    )
    add_auth_token_argument(parser)
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="bearer token the gateway presents to its targets (the file's first; default: none)",
    )
    add_client_tls_arguments(parser, "", "targets")


def register_gateway(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="serve the OpenAI-compatible HTTP API in front of routers or schedulers",
        description=(
            "Serves /v1/completions, /v1/chat/completions and /v1/models (OpenAI's HTTP API), "
            "/health and /metrics, in front of one or several schedulers or routers (their "
            "gRPC API; a broken stream resumes on the next target as the SDK does). Renders "
            "chat messages with the model's chat template. Prints one readiness line with "
            "its address. See docs/http.md."
        ),
    )
    parser.add_argument(
        "--target",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the schedulers or routers to send requests to",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="the model the targets serve: its directory, or a Hugging Face id in the local "
        "cache (for the tokenizer and chat template)",
    )
    add_gateway_arguments(parser)
    parser.set_defaults(handler=_run_gateway)


def _run_gateway(args: argparse.Namespace) -> int:
    from pagedkv.gateway.server import run_gateway

    return run_gateway(args)
