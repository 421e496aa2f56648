"""The routing benchmark's numbers: one summary per policy, the markdown table, the plot.

``summarize`` turns one policy's request records, the router's GetStats and
its counters into a JSON-ready dict; ``markdown`` puts the policies side by
side and says whether the goal (kv computes at most ``GOAL_RATIO`` times the
prefill tokens of round-robin) was met; ``plot`` draws the prefill tokens per
policy, the TTFT distributions and the hit rate over the run.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagedkv.bench.routing.load import RequestRecord
from pagedkv.v1 import scheduler_pb2

GOAL_RATIO = 0.5


def _percentile(values: Sequence[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(
    records: Sequence[RequestRecord],
    seconds: float,
    stats: scheduler_pb2.GetStatsResponse,
    counters: Mapping[str, float],
) -> dict[str, Any]:
    """One policy's results (see the module docstring)."""
    finished = [r for r in records if r.finished]
    prompt = sum(r.prompt_tokens for r in finished)
    cached = sum(r.cached_prompt_tokens for r in finished)
    ttfts = [r.ttft_s * 1e3 for r in finished if r.ttft_s is not None]
    per_executor = Counter(r.executor for r in finished)
    pairs = {(r.executor, r.prefix_index) for r in finished}
    executors = []
    for e in sorted(stats.executors, key=lambda e: e.address):
        executors.append(
            {
                "address": e.address,
                "requests": per_executor.get(e.address, 0),
                "prefix_cache_queries": e.prefix_cache_queries,
                "prefix_cache_hits": e.prefix_cache_hits,
                "distinct_prefixes": sum(1 for a, _ in pairs if a == e.address),
            }
        )
    return {
        "num_requests": len(records),
        "num_finished": len(finished),
        "errors": sorted({r.error for r in records if r.error}),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "prefill_tokens": prompt - cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_ms": {
            "p50": _percentile(ttfts, 50) if ttfts else None,
            "p99": _percentile(ttfts, 99) if ttfts else None,
            "mean": statistics.fmean(ttfts) if ttfts else None,
        },
        "seconds": seconds,
        "requests_per_s": len(finished) / seconds,
        "output_tokens_per_s": sum(r.completion_tokens for r in finished) / seconds,
        "executors": executors,
        "executors_per_prefix": len(pairs) / len({p for _, p in pairs}) if pairs else 0.0,
        "hints_seen": dict(Counter(r.hint for r in finished)),
        "router_counters": dict(counters),
        "num_preemptions": stats.num_preemptions,
        "integrity_ok": stats.integrity.ok,
    }


def goal(results: Mapping[str, Mapping[str, Any]], floor: int) -> dict[str, Any] | None:
    """kv's prefill tokens against round-robin's, when both ran, and the
    floor's (the best any placement could do) against round-robin's."""
    if "kv" not in results or "round-robin" not in results:
        return None
    kv, rr = results["kv"]["prefill_tokens"], results["round-robin"]["prefill_tokens"]
    ratio = kv / rr if rr else 0.0
    return {
        "target_ratio": GOAL_RATIO,
        "ratio": ratio,
        "met": ratio <= GOAL_RATIO,
        "floor_ratio": floor / rr if rr else 0.0,
    }


def _decisions(result: Mapping[str, Any]) -> str:
    counters = result["router_counters"]
    kinds = ("cache_hit", "cache_miss", "load_over_cache", "no_candidate")
    return ", ".join(f"{k} {counters.get(f'decisions{{{k}}}', 0):.0f}" for k in kinds)


def _hints(result: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(result["hints_seen"].items()))


def table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """The policies side by side, one markdown table."""
    policies = list(results)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, value: Any) -> None:
        rows.append((label, [value(results[p]) for p in policies]))

    row("requests finished", lambda r: f"{r['num_finished']}/{r['num_requests']}")
    row("prefill tokens computed", lambda r: f"{r['prefill_tokens']:,}")
    if "round-robin" in results:
        rr = results["round-robin"]["prefill_tokens"]
        row("... x round-robin", lambda r: f"{r['prefill_tokens'] / rr:.2f}" if rr else "-")
    row("prefix hit rate (cached / prompt tokens)", lambda r: f"{r['hit_rate']:.3f}")
    row("TTFT p50 (ms)", lambda r: _ms(r["ttft_ms"]["p50"]))
    row("TTFT p99 (ms)", lambda r: _ms(r["ttft_ms"]["p99"]))
    row("output tokens/s", lambda r: f"{r['output_tokens_per_s']:.0f}")
    row("requests/s", lambda r: f"{r['requests_per_s']:.1f}")
    row("requests per executor", lambda r: " / ".join(str(e["requests"]) for e in r["executors"]))
    row(
        "distinct prefixes per executor",
        lambda r: " / ".join(str(e["distinct_prefixes"]) for e in r["executors"]),
    )
    row("executors per prefix (mean)", lambda r: f"{r['executors_per_prefix']:.2f}")
    row("router decisions", _decisions)
    row("placement hints (first chunks)", _hints)
    row("preemptions", lambda r: str(r["num_preemptions"]))
    lines = ["| | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(values) + " |" for label, values in rows]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot(
    results: Mapping[str, Mapping[str, Any]],
    records: Mapping[str, Sequence[RequestRecord]],
    path: Path,
) -> None:
    """Three panels: prefill tokens per policy (with the goal line), TTFT
    CDFs, and the cumulative prefix hit rate over completed requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    values = [results[p]["prefill_tokens"] for p in policies]
    bars = axes[0].bar(policies, values, color=[f"C{i}" for i in range(len(policies))])
    axes[0].bar_label(bars, labels=[f"{v:,}" for v in values])
    if "round-robin" in results:
        line = GOAL_RATIO * results["round-robin"]["prefill_tokens"]
        axes[0].axhline(line, color="black", linestyle="--", label="goal: 0.5 x round-robin")
        axes[0].legend(loc="lower right")
    axes[0].set_ylabel("prefill tokens computed")
    axes[0].set_title("prefill tokens (prompt - cached), summed")
    for i, policy in enumerate(policies):
        ttfts = sorted(r.ttft_s * 1e3 for r in records[policy] if r.ttft_s is not None)
        if ttfts:
            share = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
            axes[1].step(ttfts, share, where="post", color=f"C{i}", label=policy)
        done = sorted((r for r in records[policy] if r.finished), key=lambda r: r.end_s)
        prompt = cached = 0
        rates = []
        for r in done:
            prompt += r.prompt_tokens
            cached += r.cached_prompt_tokens
            rates.append(cached / prompt if prompt else 0.0)
        axes[2].plot(range(1, len(rates) + 1), rates, color=f"C{i}", label=policy)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("TTFT (ms, client side)")
    axes[1].set_ylabel("share of requests")
    axes[1].set_title("TTFT distribution")
    axes[1].legend()
    axes[2].set_xlabel("requests completed")
    axes[2].set_ylabel("cumulative prefix hit rate")
    axes[2].set_ylim(0, 1)
    axes[2].set_title("hit rate over the run")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
