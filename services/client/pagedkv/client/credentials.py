"""The credentials of the commands that call a server (``pagedkv generate``,
``stats``, ``demo``): their TLS and token options, and the ``tls`` and
``token`` keyword arguments of ``Client`` they give."""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.common.cli import add_client_tls_arguments

TOKEN_ENV = "PAGEDKV_TOKEN"


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """TLS and token options of a command that calls a server."""
    add_client_tls_arguments(parser, "", "servers")
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"file whose first token is sent as authorization: Bearer <token> "
        f"(default: the {TOKEN_ENV} environment variable, if set)",
    )


def client_security(args: argparse.Namespace) -> dict[str, Any]:
    """The ``tls`` and ``token`` keyword arguments of ``Client`` for the
    command's options; ValueError naming the option (never its secret)."""
    import os

    from pagedkv.common.bearer_tokens import read_token
    from pagedkv.common.security import client_tls_from_args

    tls = client_tls_from_args(args, "")
    token = os.environ.get(TOKEN_ENV) or None
    if args.token_file is not None:
        token = read_token(args.token_file)
    return {"tls": tls, "token": token}
