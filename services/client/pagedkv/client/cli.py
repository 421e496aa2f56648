"""Registers ``pagedkv generate`` and ``pagedkv stats``, thin commands over
``Client``, and ``pagedkv demo`` (``pagedkv.client.demo``).

The register functions only declare arguments; the handlers import the SDK
and do the work. ``generate`` and ``stats`` exit 0 on success and 1 on a
failed call, printing ``pagedkv: <CODE>: <details>`` to stderr; 2 for
arguments the SDK refuses before calling.

``pagedkv generate``'s request flags are the SDK's request options
(``GenerateOptions``): ``GENERATE_FLAGS`` declares one flag per option, by
the option's name, and ``generate_options`` reads them back under the same
names, so no option is listed twice. What the commands print is
``pagedkv.client.render``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from argparse import SUPPRESS
from typing import TYPE_CHECKING, Any, cast

from pagedkv.client.credentials import add_security_arguments, client_security
from pagedkv.common.cli import DEFAULT_SCHEDULER_PORT

if TYPE_CHECKING:
    from pagedkv.client.errors import PagedkvError
    from pagedkv.client.options import GenerateOptions
    from pagedkv.client.types import GenerateChunk

_GENERATE_EPILOG = """\
output:
  Without --json, a single sequence (--n 1, no beam search) is printed as its
  text arrives. With --n > 1 or --beam-width >= 2, each sequence (or beam, best
  first) is printed at the end under a "--- sequence I (REASON) ---" header.
  On a terminal, control characters of the text other than newline and tab
  are shown escaped (\\x1b); piped output carries the text unchanged.
  A usage line goes to stderr. Logprobs are only shown with --json.

  With --json, each chunk of the stream is one JSON object on its own line:
  {"request_id", "sequences": [{"index", "token_ids", "text", "finish_reason",
  and "stop_token_id", "stop_string", "error_message", "logprobs" when set}],
  "beams" (beam search, final chunk), "usage" (final chunk only)}. With
  --skip-text the scheduler makes no text: every "text" is empty (token ids
  only).
"""


def _token_id_list(value: str) -> list[int]:
    """Parses "1,2,3" into [1, 2, 3]."""
    try:
        ids = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids like 1,2,3, got {value!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


TARGET_HELP = f"HOST[:PORT] (default port: {DEFAULT_SCHEDULER_PORT}, where pagedkv serve listens)"

DEFAULT_TARGET = f"localhost:{DEFAULT_SCHEDULER_PORT}"
"""The Scheduler that ``generate`` and ``stats`` call without ``--target``:
where ``pagedkv serve`` listens by default."""

DEFAULT_MAX_TOKENS = 16
"""``generate``'s tokens per sequence without ``--max-tokens`` (as in the
usual completions APIs); the SDK leaves max_tokens to the scheduler, which
generates up to the model's length."""


def _add_target(parser: argparse.ArgumentParser, several: str) -> None:
    parser.add_argument(
        "--target",
        action="append",
        help=f"the Scheduler's address, {TARGET_HELP}; several replicas: repeat the flag "
        f"or separate them with commas (a,b:50052); {several} (default: {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout", type=float, help="deadline of the call in seconds (default: none)"
    )


def _targets(args: argparse.Namespace) -> list[str]:
    """Every --target, comma-separated ones split."""
    from pagedkv.common.resume import parse_targets

    values = args.target or [DEFAULT_TARGET]
    return [target for value in values for target in parse_targets(value)]


GENERATE_FLAGS: dict[str, dict[str, Any]] = {
    "max_tokens": {"type": int, "default": DEFAULT_MAX_TOKENS, "help": "tokens per sequence"},
    "n": {"type": int, "help": "independent samples (default: 1)"},
    "temperature": {"type": float, "help": "0: greedy (default: 1.0)"},
    "top_p": {"type": float, "help": "nucleus sampling, in (0, 1] (default: 1.0, disabled)"},
    "top_k": {"type": int, "help": "0: disabled (default)"},
    "seed": {"type": int, "help": "for reproducible sampling (default: none, nondeterministic)"},
    "beam_width": {"type": int, "help": ">= 2: beam search (default: 0, off)"},
    "stop_token_ids": {"type": _token_id_list, "help": "e.g. 13,198 (default: none)"},
    "ignore_eos": {"action": "store_true", "help": "do not stop at EOS"},
    "stop": {
        "action": "append",
        "help": "a stop string: the text ends before it (repeat for several; default: none)",
    },
    "include_stop_str_in_output": {
        "action": "store_true",
        "help": "end the text after the stop string instead",
    },
    "min_tokens": {
        "type": int,
        "help": "tokens before EOS or a stop may end a sequence (default: 0)",
    },
    "logprobs": {"type": int, "help": "top-K logprobs per token (--json) (default: none)"},
    "skip_text": {"action": "store_true", "help": "token ids only, no text (needs --json)"},
}
"""``pagedkv generate``'s flags, one per request option it sends (a key of
``GenerateOptions``; the flag is its name with dashes: ``--max-tokens``),
each with its ``add_argument`` arguments. A flag not given is not sent, so
the SDK's default applies (``generate_options``); only ``--max-tokens`` has
a default of its own. ``cache_salt``, ``priority`` and ``request_id`` have
no flag."""


def generate_options(args: argparse.Namespace) -> GenerateOptions:
    """The request options of ``pagedkv generate``'s parsed flags: every one
    given (``--token-ids`` and ``GENERATE_FLAGS``), under its option name."""
    names = ("token_ids", *GENERATE_FLAGS)
    return cast("GenerateOptions", {name: getattr(args, name) for name in names if name in args})


def register_generate(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="generate from a prompt through a Scheduler, streaming the output",
        description="Sends one Generate request and prints its output as it arrives.",
        epilog=_GENERATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target(
        parser,
        "the request starts on the first and a stream that breaks (its scheduler gone) "
        "resumes on the next",
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, tokenized by the scheduler")
    prompt.add_argument(
        "--token-ids", type=_token_id_list, help="already-tokenized prompt, e.g. 1,2,3"
    )
    for option, flag in GENERATE_FLAGS.items():
        parser.add_argument("--" + option.replace("_", "-"), **{"default": SUPPRESS, **flag})
    parser.add_argument("--json", action="store_true", help="one JSON object per chunk")
    add_security_arguments(parser)
    parser.set_defaults(handler=_run_generate)


def register_stats(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="show a Scheduler's executors, load and block-pool integrity",
        description="Prints one GetStats snapshot as a table (or JSON with --json).",
    )
    _add_target(parser, "each one's stats are printed in turn")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object (per target, one per line)"
    )
    add_security_arguments(parser)
    parser.set_defaults(handler=_run_stats)


def register_demo(subparsers: Any, name: str) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="start a tiny local stack and stream a short workload through the SDK",
        description=(
            "Starts `pagedkv serve` (unless --target is given), streams concurrent chat "
            "requests that share long system prompts (prefix cache) and one n=4 request "
            "(shared blocks) with progress bars, then prints the final stats: KV usage, "
            "prefix-cache hits, free and held blocks, preemptions, integrity."
        ),
    )
    parser.add_argument(
        "--target",
        help=f"an already running Scheduler, {TARGET_HELP}; without it, one is started",
    )
    parser.add_argument(
        "--model",
        help="without --target: a model directory or the id of a model in the local Hugging "
        "Face cache (default: a tiny random llama)",
    )
    parser.add_argument(
        "--executors", type=int, default=2, help="without --target: executor processes"
    )
    parser.add_argument("--requests", type=int, default=24, help="chat requests")
    parser.add_argument("--concurrency", type=int, default=8, help="chat streams at a time")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per sequence")
    add_security_arguments(parser)
    parser.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from pagedkv.client.demo import run_demo

    return run_demo(args)


def _fail(exc: PagedkvError) -> int:
    print(f"pagedkv: {exc.code.name}: {exc.details}", file=sys.stderr)
    return 1


def _run_generate(args: argparse.Namespace) -> int:
    from pagedkv.client.client import Client
    from pagedkv.client.errors import PagedkvError
    from pagedkv.client.render import chunk_json, completion_text, terminal_text
    from pagedkv.client.types import Completion

    options = generate_options(args)
    if options.get("skip_text") and not args.json:
        print("pagedkv generate: --skip-text makes no text to print; add --json", file=sys.stderr)
        return 2
    one_sequence = options.get("n", 1) <= 1 and options.get("beam_width", 0) < 2
    streams_text = not args.json and one_sequence
    chunks: list[GenerateChunk] = []
    out = sys.stdout
    shown = terminal_text if out.isatty() else str
    try:
        security = client_security(args)
    except ValueError as exc:
        print(f"pagedkv generate: {exc}", file=sys.stderr)
        return 2
    try:
        with Client(_targets(args), timeout=args.timeout, **security) as client:
            for chunk in client.generate(args.prompt, **options):
                chunks.append(chunk)
                if args.json:
                    out.write(json.dumps(chunk_json(chunk)) + "\n")
                elif streams_text:
                    out.write(shown("".join(seq.text for seq in chunk.sequences)))
                out.flush()
    except ValueError as exc:
        print(f"pagedkv: {exc}", file=sys.stderr)
        return 2
    except PagedkvError as exc:
        if streams_text and chunks:
            out.write("\n")
        return _fail(exc)
    if args.json:
        return 0
    completion = Completion.from_chunks(chunks)
    if streams_text:
        out.write("\n")
    else:
        out.write(completion_text(completion, shown))
    reasons = ",".join(r.value if r else "-" for r in completion.finish_reasons)
    usage = completion.usage
    print(
        f"request {completion.request_id}: prompt {usage.prompt_tokens} tokens "
        f"({usage.cached_prompt_tokens} cached), completion {usage.completion_tokens} tokens"
        + (f", finish {reasons}" if reasons else ""),
        file=sys.stderr,
    )
    return 0


def _run_stats(args: argparse.Namespace) -> int:
    from pagedkv.client.client import Client
    from pagedkv.client.errors import PagedkvError
    from pagedkv.client.render import stats_json, stats_table

    try:
        security = client_security(args)
    except ValueError as exc:
        print(f"pagedkv stats: {exc}", file=sys.stderr)
        return 2
    code = 0
    with Client(_targets(args), timeout=args.timeout, **security) as client:
        for target in client.targets:
            try:
                stats = client.stats(target=target)
            except PagedkvError as exc:
                code = _fail(exc)
                continue
            out = json.dumps(stats_json(stats)) + "\n" if args.json else stats_table(stats)
            sys.stdout.write(out)
    return code
