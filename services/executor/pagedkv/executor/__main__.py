"""``python -m pagedkv.executor ARGS``: the same as ``pagedkv [--log-level L]
[--log-format F] executor ARGS``, for images and environments without the
installed entry points (the logging options go among ARGS)."""

from __future__ import annotations

import argparse
import sys

from pagedkv.common.cli import add_logging_arguments, show_defaults
from pagedkv.common.logging import configure_logging
from pagedkv.executor.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.executor")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers, "executor")
    add_logging_arguments(subparsers.choices["executor"])
    show_defaults(parser)
    args = parser.parse_args(["executor", *(sys.argv[1:] if argv is None else argv)])
    configure_logging(args.log_format, args.log_level)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
