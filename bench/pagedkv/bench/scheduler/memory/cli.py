"""Registers ``pagedkv bench memory`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.common.cli import requires


@requires("pagedkv.executor")  # it starts executors
def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="KV memory of the live stack: paged against contiguous reservation, 3 scenarios",
        description=(
            "Starts `pagedkv serve` on a CPU executor (a tiny random llama, max_model_len "
            "4096, 16-token blocks), runs three scenarios (chat with varied lengths, a shared "
            "system prompt, beam search) and reads the blocks held from GetStats while they "
            "run, beside a contiguous reservation of the same requests."
        ),
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--chat-requests", type=int, default=30)
    parser.add_argument("--chat-mean-len", type=int, default=1331)
    parser.add_argument(
        "--chat-output-fraction", type=float, default=0.125, help="of each length, generated"
    )
    parser.add_argument(
        "--chat-budget-requests",
        type=int,
        default=20,
        help="the KV budget, in contiguous reservations of max_model_len",
    )
    parser.add_argument("--shared-requests", type=int, default=100)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--user-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--width", type=int, default=4, help="beams, and n of parallel sampling")
    parser.add_argument("--beam-prompt-len", type=int, default=2048)
    parser.add_argument("--beam-tokens", type=int, default=256)
    parser.add_argument(
        "--scenarios", default="chat,shared,beams", help="which to run (comma-separated)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8_e4m3", "fp8_e5m2", "int8"),
        help="the executor's KV blocks (default auto: the model's dtype)",
    )
    parser.add_argument(
        "--output",
        help="write JSON here (and .md and .png plots beside it) (default: none, printed only)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pagedkv.bench.scheduler.memory.run import main

    return main(args)
