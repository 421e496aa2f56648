"""Registers ``pagedkv bench train-model`` (imports torch only when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pagedkv.common.cli import requires


@requires("pagedkv.executor")  # torch, transformers and the byte-level tokenizer
def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="train a small llama on text that ships with Python (for accuracy measurements)",
        description="Trains a llama on the standard library's sources and help topics "
        "(pagedkv.bench.accuracy.train) and saves it where pagedkv executor --model reads it.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=_run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe's options (``pagedkv bench train-model`` and train.py's ``main``)."""
    parser.add_argument("--out", required=True, type=Path, help="the model's directory")
    parser.add_argument("--shape", choices=("small", "cpu", "tiny"), default="small")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--minutes", type=float, default=5.0, help="stop after this long")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--device", default=None, help="default: cuda when there is one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-corpus-bytes",
        type=int,
        default=None,
        help="stop reading the corpus once its training split holds this many bytes "
        "(default: all of it)",
    )
    parser.add_argument(
        "--report", type=Path, help="also copy training.json here (without it, only into --out)"
    )


def _run(args: argparse.Namespace) -> int:
    from pagedkv.bench.accuracy.train import run

    return run(args)
