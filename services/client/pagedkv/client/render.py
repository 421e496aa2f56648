"""The text and JSON forms of results that the commands print:
``pagedkv generate``'s chunks and completions, ``pagedkv stats``' table and
object (``pagedkv demo``'s report reuses the table's parts).

Pure functions of ``pagedkv.client.types`` values; nothing here calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pagedkv.client.stats import ClusterView, ExecutorStats, Stats
from pagedkv.client.types import Completion, GenerateChunk

_TERMINAL_ESCAPES = {
    code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7F, 0xA0)] if chr(code) not in "\n\t"
}
"""Control characters (Unicode category Cc) but newline and tab, to their
escapes: a model can emit any byte, and a terminal acts on these."""


def terminal_text(text: str) -> str:
    """``text`` with control characters other than newline and tab shown as
    escapes (ESC as ``\\x1b``), to write model output to a terminal."""
    return text.translate(_TERMINAL_ESCAPES)


def chunk_json(chunk: GenerateChunk) -> dict[str, object]:
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


def completion_text(completion: Completion, shown: Callable[[str], str]) -> str:
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


def stats_json(stats: Stats) -> dict[str, object]:
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


def stats_table(stats: Stats) -> str:
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
        lines += cluster_lines(stats.cluster)
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


def cluster_lines(cluster: ClusterView) -> list[str]:
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
