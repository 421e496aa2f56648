"""Registers ``pagedkv bench train-model`` (imports torch only when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.common.cli import requires


@requires("pagedkv.executor")  # torch, transformers and the byte-level tokenizer
def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="train a small llama on text that ships with Python (for accuracy measurements)",
        description="Trains a llama on the standard library's sources and help topics "
        "(pagedkv.bench.accuracy.train) and saves it where pagedkv executor --model reads it.",
        add_help=False,
    )
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="train.py's own options")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pagedkv.bench.accuracy.train import main

    return main(args.rest)
