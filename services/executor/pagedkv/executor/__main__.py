"""``python -m pagedkv.executor ARGS``: the same as ``pagedkv executor ARGS``,
for images and environments without the installed entry points."""

from __future__ import annotations

import argparse
import sys

from pagedkv.common.logging import configure_logging
from pagedkv.executor.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.executor")
    register(parser.add_subparsers(dest="command", required=True), "executor")
    args = parser.parse_args(["executor", *(sys.argv[1:] if argv is None else argv)])
    configure_logging("console")
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
