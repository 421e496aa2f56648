"""Registers ``pagedkv bench serve`` (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from pagedkv.common.cli import requires
from pagedkv.common.step_contract import DEFAULT_DECODE_WINDOW

PRESETS = ("tiny", "llama-1.1b", "llama-8b")


def _checked(module: str, parser: str) -> Callable[[str], str]:
    """An argparse type that keeps the text once ``parser`` of
    ``pagedkv.bench.scheduler.serving.<module>`` reads it (imported only when
    the option is parsed), so a bad value is refused in one line naming the
    option, before anything starts."""

    def check(text: str) -> str:
        parse = getattr(
            importlib.import_module(f"pagedkv.bench.scheduler.serving.{module}"), parser
        )
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


@requires("pagedkv.executor")  # it starts executors
def register(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="serving benchmark: latency and throughput per request rate, a fixed batch "
        "against Hugging Face generate",
        description=(
            "Starts pagedkv serve (or uses --target), sends a seeded ShareGPT-like mix at "
            "Poisson arrival times for each of --rates and reports output tok/s, requests/s, "
            "TTFT, TPOT and ITL percentiles and goodput under an SLO; then a fixed batch "
            "sent at once, side by side with Hugging Face generate on the same device "
            "(after the server stopped); optionally a GPU timeline of decode steps. "
            "JSON, markdown and a PNG with --output."
        ),
    )
    model = parser.add_argument_group("model and server")
    model.add_argument("--model", help="model directory (default: --preset)")
    model.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="without --model: tiny (a random llama made now), llama-1.1b (the executor "
        "bench's shape) or llama-8b (Llama-3-8B's shape); the llama ones have dummy weights",
    )
    model.add_argument(
        "--target",
        help="a running scheduler HOST:PORT instead of starting one (default: none, one is "
        "started)",
    )
    model.add_argument("--device", default="cpu")
    model.add_argument("--dtype", default="auto")
    model.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    model.add_argument(
        "--kernel-backend",
        choices=("triton", "torch"),
        help="the executor's attention kernels (default: the executor's)",
    )
    model.add_argument("--num-blocks", type=int, help="KV blocks (default: as serve sizes them)")
    model.add_argument(
        "--kv-cache-dtype",
        help="the executor's KV blocks, e.g. fp8_e4m3 (default: the executor's, the model's dtype)",
    )
    model.add_argument(
        "--host-kv-gib",
        type=float,
        help="the executor's host-memory KV tier in GiB (default: none; docs/memory.md)",
    )
    model.add_argument(
        "--host-offload",
        choices=("write-through", "eviction"),
        help="with --host-kv-gib: the scheduler's --host-offload (default: its own)",
    )
    model.add_argument(
        "--host-idle-offload-blocks",
        type=int,
        help="with --host-kv-gib: the scheduler's --host-idle-offload-blocks (default: its own)",
    )
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--max-num-batched-tokens", type=int, default=8192)
    model.add_argument(
        "--decode-window",
        type=int,
        default=DEFAULT_DECODE_WINDOW,
        help="the scheduler's --decode-window (default its default)",
    )
    model.add_argument(
        "--pipeline-depth",
        type=int,
        help="the scheduler's --pipeline-depth (default its default for the window)",
    )
    model.add_argument("--max-model-len", type=int, help="clip lengths to this (default: model's)")
    model.add_argument("--enforce-eager", action="store_true")
    model.add_argument(
        "--cuda-graphs",
        default="all",
        choices=("all", "decode"),
        help="the executor's steps replayed from CUDA graphs (pagedkv serve's --cuda-graphs)",
    )
    mix = parser.add_argument_group("the ShareGPT-like mix at Poisson rates")
    mix.add_argument(
        "--rates",
        default="2,4,8,16,inf",
        type=_checked("workload", "parse_rates"),
        help="requests/s, comma-separated (inf: all at once; empty: none)",
    )
    mix.add_argument("--num-requests", type=int, default=200, help="requests per rate")
    mix.add_argument("--mean-prompt-len", type=float, default=220.0)
    mix.add_argument("--mean-output-len", type=float, default=190.0)
    mix.add_argument("--sigma", type=float, default=1.0, help="of the lognormal lengths")
    mix.add_argument("--system-prompt-fraction", type=float, default=0.3)
    mix.add_argument("--num-system-prompts", type=int, default=4)
    mix.add_argument("--system-prompt-len", type=int, default=128)
    mix.add_argument("--warmup-requests", type=int, default=16, help="sent before the rates")
    mix.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput: TTFT limit")
    mix.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput: TPOT limit")
    fixed = parser.add_argument_group("the fixed batch")
    fixed.add_argument(
        "--fixed-batch",
        default="64x512x256",
        type=_checked("run", "parse_fixed_batches"),
        help="NxPxO[,...]: N requests of P prompt tokens -> O new tokens, all at once; empty: none",
    )
    fixed.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    fixed.add_argument("--hf-repeat", type=int, default=2, help="timed generate calls")
    timeline = parser.add_argument_group("GPU timeline (CUDA)")
    timeline.add_argument(
        "--timeline-steps",
        type=int,
        default=0,
        help="profile this many decode steps of the first fixed batch on a fresh stack "
        "(a profiled executor and a scheduler) and measure GPU idle between them; 0: no",
    )
    timeline.add_argument("--timeline-skip", type=int, default=20, help="decode steps first")
    parser.add_argument(
        "--step-trace",
        action="store_true",
        help="trace every step in the server's processes (pagedkv.common.step_trace) and "
        "report where the first fixed batch's step time went",
    )
    parser.add_argument(
        "--sweep",
        metavar="W:D[,...]",
        type=_checked("sweep", "parse_settings"),
        help="instead of the runs above: the fixed batches once per setting (decode window W, "
        "pipeline depth D), each on a fresh scheduler over one executor, with step traces "
        "(default: none, the runs above)",
    )
    parser.add_argument(
        "--gateway",
        action="store_true",
        help="also send each rate and fixed batch through a pagedkv gateway started in front "
        "of the scheduler (the OpenAI API over HTTP, streamed), right after its gRPC run, and "
        "compare: output tok/s, TTFT and ITL, the gateway's CPU per 1,000 tokens",
    )
    parser.add_argument(
        "--http-clients",
        type=int,
        default=1,
        help="with --gateway: send the HTTP load from this many client processes, the "
        "requests dealt out round-robin, should one be near a core (default: 1)",
    )
    parser.add_argument(
        "--gateway-probe",
        type=int,
        default=0,
        metavar="N",
        help="with --gateway: before the fixed batches, N requests each way one at a time, "
        "alternating gRPC and HTTP, for the latency the gateway adds to a request with nothing "
        "else in flight (default: 0, none)",
    )
    parser.add_argument(
        "--grpc-text",
        action="store_true",
        help="the gRPC requests ask for the outputs' text, as the gateway's do (default: "
        "token ids only, skip_text)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        help="write JSON here (and .md and .png beside it) (default: none, printed only)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pagedkv.bench.scheduler.serving.run import main

    return main(args)
