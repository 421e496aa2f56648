"""Registers ``pagedkv generate`` and ``pagedkv stats``, thin commands over
``Client``, and ``pagedkv demo`` (``pagedkv.client.demo``).

The register functions only declare arguments; the handlers import the SDK
and do the work. ``generate`` and ``stats`` exit 0 on success and 1 on a
failed call, printing ``pagedkv: <CODE>: <details>`` to stderr; 2 for
arguments the SDK refuses before calling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.common.cli import DEFAULT_SCHEDULER_PORT, add_client_tls_arguments

if TYPE_CHECKING:
    from pagedkv.client.errors import PagedkvError
    from pagedkv.client.types import (
        ClusterView,
        Completion,
        ExecutorStats,
        GenerateChunk,
        Stats,
    )

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


_TERMINAL_ESCAPES = {
    code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7F, 0xA0)] if chr(code) not in "\n\t"
}
"""Control characters (Unicode category Cc) but newline and tab, to their
escapes: a model can emit any byte, and a terminal acts on these."""


def terminal_text(text: str) -> str:
    """``text`` with control characters other than newline and tab shown as
    escapes (ESC as ``\\x1b``), to write model output to a terminal."""
    return text.translate(_TERMINAL_ESCAPES)


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


TOKEN_ENV = "PAGEDKV_TOKEN"


def _add_security(parser: argparse.ArgumentParser) -> None:
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

    from pagedkv.common.security import client_tls_from_args, read_token

    tls = client_tls_from_args(args, "")
    token = os.environ.get(TOKEN_ENV) or None
    if args.token_file is not None:
        token = read_token(args.token_file)
    return {"tls": tls, "token": token}


def _targets(args: argparse.Namespace) -> list[str]:
    """Every --target, comma-separated ones split."""
    from pagedkv.client.resume import parse_targets

    values = args.target or [DEFAULT_TARGET]
    return [target for value in values for target in parse_targets(value)]


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
    parser.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens per sequence"
    )
    parser.add_argument("--n", type=int, default=1, help="independent samples")
    parser.add_argument("--temperature", type=float, help="0: greedy (default: 1.0)")
    parser.add_argument(
        "--top-p", type=float, help="nucleus sampling, in (0, 1] (default: 1.0, disabled)"
    )
    parser.add_argument("--top-k", type=int, default=0, help="0: disabled (default)")
    parser.add_argument(
        "--seed", type=int, help="for reproducible sampling (default: none, nondeterministic)"
    )
    parser.add_argument("--beam-width", type=int, default=0, help=">= 2: beam search")
    parser.add_argument(
        "--stop-token-ids", type=_token_id_list, default=[], help="e.g. 13,198 (default: none)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a stop string: the text ends before it (repeat for several; default: none)",
    )
    parser.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="end the text after the stop string instead",
    )
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="tokens before EOS or a stop may end a sequence (default: 0)",
    )
    parser.add_argument(
        "--logprobs", type=int, help="top-K logprobs per token (--json) (default: none)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per chunk")
    parser.add_argument(
        "--skip-text", action="store_true", help="token ids only, no text (needs --json)"
    )
    _add_security(parser)
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
    _add_security(parser)
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
    _add_security(parser)
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
    from pagedkv.client.types import Completion

    if args.skip_text and not args.json:
        print("pagedkv generate: --skip-text makes no text to print; add --json", file=sys.stderr)
        return 2
    streams_text = not args.json and args.n <= 1 and args.beam_width < 2
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
            stream = client.generate(
                args.prompt,
                token_ids=args.token_ids,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                n=args.n,
                beam_width=args.beam_width,
                stop_token_ids=args.stop_token_ids,
                ignore_eos=args.ignore_eos,
                stop=args.stop,
                include_stop_str_in_output=args.include_stop_str_in_output,
                min_tokens=args.min_tokens,
                logprobs=args.logprobs,
                skip_text=args.skip_text,
            )
            for chunk in stream:
                chunks.append(chunk)
                if args.json:
                    out.write(json.dumps(_chunk_json(chunk)) + "\n")
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
        out.write(_completion_text(completion, shown))
    reasons = ",".join(r.value if r else "-" for r in completion.finish_reasons)
    usage = completion.usage
    print(
        f"request {completion.request_id}: prompt {usage.prompt_tokens} tokens "
        f"({usage.cached_prompt_tokens} cached), completion {usage.completion_tokens} tokens"
        + (f", finish {reasons}" if reasons else ""),
        file=sys.stderr,
    )
    return 0


def _chunk_json(chunk: GenerateChunk) -> dict[str, object]:
    """The --json line of one chunk (see the epilog)."""
    sequences: list[dict[str, object]] = []
    for seq in chunk.sequences:
        obj: dict[str, object] = {
            "index": seq.index,
            "token_ids": list(seq.token_ids),
            "text": seq.text,
            "finish_reason": seq.finish_reason.value if seq.finish_reason else None,
        }
        if seq.stop_token_id is not None:
            obj["stop_token_id"] = seq.stop_token_id
        if seq.stop_string is not None:
            obj["stop_string"] = seq.stop_string
        if seq.error_message is not None:
            obj["error_message"] = seq.error_message
        if seq.logprobs:
            obj["logprobs"] = [
                {
                    "logprob": lp.logprob,
                    "top_token_ids": list(lp.top_token_ids),
                    "top_logprobs": list(lp.top_logprobs),
                }
                for lp in seq.logprobs
            ]
        sequences.append(obj)
    line: dict[str, object] = {"request_id": chunk.request_id, "sequences": sequences}
    if chunk.beams:
        line["beams"] = [
            {
                "token_ids": list(beam.token_ids),
                "text": beam.text,
                "cumulative_logprob": beam.cumulative_logprob,
                "finish_reason": beam.finish_reason.value if beam.finish_reason else None,
            }
            for beam in chunk.beams
        ]
    if chunk.usage is not None:
        line["usage"] = {
            "prompt_tokens": chunk.usage.prompt_tokens,
            "cached_prompt_tokens": chunk.usage.cached_prompt_tokens,
            "completion_tokens": chunk.usage.completion_tokens,
        }
    return line


def _completion_text(completion: Completion, shown: Callable[[str], str]) -> str:
    """Every sequence (or beam) under its own header, for --n > 1 and beam
    search; each text passed through ``shown``."""
    parts: list[str] = []
    for i, text in enumerate(completion.texts):
        reason = completion.finish_reasons[i]
        parts.append(f"--- sequence {i} ({reason.value if reason else '-'}) ---\n{shown(text)}\n")
    for i, beam in enumerate(completion.beams):
        reason_text = beam.finish_reason.value if beam.finish_reason else "-"
        header = f"beam {i} ({reason_text}, logprob {beam.cumulative_logprob:.4f})"
        parts.append(f"--- {header} ---\n{shown(beam.text)}\n")
    return "".join(parts)


def _run_stats(args: argparse.Namespace) -> int:
    from pagedkv.client.client import Client
    from pagedkv.client.errors import PagedkvError

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
            out = json.dumps(_stats_json(stats)) + "\n" if args.json else _stats_table(stats)
            sys.stdout.write(out)
    return code


def _stats_json(stats: Stats) -> dict[str, object]:
    """The --json object: every Stats field, plus each executor's hit rate."""
    obj = dataclasses.asdict(stats)
    for ex_obj, ex in zip(obj["executors"], stats.executors, strict=True):
        ex_obj["prefix_cache_hit_rate"] = ex.prefix_cache_hit_rate
    return obj


NULL_BLOCK_NOTE = "usable blocks: all but the null block 0 of each pool, which holds no KV"
SUSPECT_NOTE = "suspect: healthy, but its step in flight has run far longer than its recent steps"


def executor_state(ex: ExecutorStats) -> str:
    """ "healthy", "suspect" (healthy, a step running long) or "DOWN"."""
    if not ex.healthy:
        return "DOWN"
    return "suspect" if ex.suspect else "healthy"


def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], num_left: int = 1) -> list[str]:
    """Lines of a table: the first ``num_left`` columns left-aligned, the
    others (numbers) right-aligned."""
    widths = [max(len(row[col]) for row in [header, *rows]) for col in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if col < num_left else cell.rjust(width)
            for col, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [header, *rows]
    ]


def _stats_table(stats: Stats) -> str:
    """One row per executor, notes on what the table shows, why executors
    are down, then the replica's load, internal errors and integrity."""
    header = (
        "EXECUTOR", "STATE", "FREE/USABLE BLOCKS", "KV USAGE", "PREFIX HIT RATE", "RECOVERIES"
    )  # fmt: skip
    rows = [
        (
            ex.address,
            executor_state(ex),
            f"{ex.num_free_blocks}/{ex.num_usable_blocks}",
            f"{ex.kv_cache_usage:.1%}",
            "-" if ex.prefix_cache_hit_rate is None else f"{ex.prefix_cache_hit_rate:.1%}",
            str(ex.num_recoveries),
        )
        for ex in stats.executors
    ]
    who = "router" if stats.router is not None else "scheduler"
    lines = [f"{who} {stats.scheduler_id or '-'}", *table(header, rows, 2), NULL_BLOCK_NOTE]
    if any(ex.healthy and ex.suspect for ex in stats.executors):
        lines.append(SUSPECT_NOTE)
    lines += [f"{ex.address} is down: {ex.down_reason}" for ex in stats.executors if ex.down_reason]
    lines.append(
        f"running {stats.num_running}, waiting {stats.num_waiting}, "
        f"preemptions {stats.num_preemptions}, {internal_errors(stats)}, "
        f"integrity {integrity(stats)}" + (", DRAINING (admits nothing)" if stats.draining else "")
    )
    if stats.cluster is not None:
        lines += _cluster_lines(stats.cluster)
    if stats.router is not None:
        router = stats.router
        lines.append(
            f"router policy {router.policy}: {router.num_indexed_blocks} cached blocks indexed "
            f"over {router.num_followed_executors} executors, KV event lag "
            f"{router.kv_event_lag_seconds * 1000:.0f} ms"
        )
        if router.unreachable_scheduler_ids:
            lines.append("unreachable schedulers: " + ", ".join(router.unreachable_scheduler_ids))
    return "\n".join(lines) + "\n"


def _cluster_lines(cluster: ClusterView) -> list[str]:
    """The cluster as Redis shows it: its schedulers, and who leases which executor."""
    state = f"DEGRADED: {cluster.detail}" if cluster.degraded else "ok"
    lines = [f"cluster {state}; schedulers: {', '.join(cluster.scheduler_ids) or '-'}"]
    rows = [
        (e.address, e.owner_id or "-", str(e.epoch) if e.epoch else "-", e.incarnation_id[:12])
        for e in cluster.executors
    ]
    return lines + table(("REGISTERED EXECUTOR", "LEASED BY", "EPOCH", "INCARNATION"), rows, 2)


def internal_errors(stats: Stats) -> str:
    """ "internal errors N", pointing at the log when N > 0."""
    n = stats.num_internal_errors
    return f"internal errors {n}" + (" (see the scheduler's log)" if n else "")


def integrity(stats: Stats) -> str:
    return "ok" if stats.integrity.ok else f"FAILED: {stats.integrity.message}"
