"""The numbers of one run: throughput, latency percentiles, goodput under an SLO.

Per request (client side, from the send):
- TTFT: to the first chunk with tokens;
- TPOT (time per output token): (end - first token) / (tokens - 1), for
  requests of at least two tokens;
- ITL (inter-token latency): the gap between consecutive chunks with tokens,
  split evenly over that chunk's tokens (a chunk of k tokens counts k gaps of
  gap / k), pooled over every request.
Goodput: requests per second that finished with all their tokens and met
both limits (TTFT <= ``ttft_ms`` and TPOT <= ``tpot_ms``; a one-token
request has no TPOT and is judged on TTFT alone).
Chunks: the chunks (or HTTP events) that carried tokens, over all requests.
Concurrency: requests in flight, averaged over the run (sum of latencies /
duration).
Failed requests (an error, or a stream that ended without usage) are counted
with the first one's error (the earliest sent). Output tokens count every
token received, a failed request's included; the latencies are of the
finished requests only, None when none finished.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.scheduler.serving.load import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Slo:
    """The latency objective of goodput, in milliseconds."""

    ttft_ms: float
    tpot_ms: float


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 (inclusive method) and the mean; None for no values."""
    if not values:
        return dict.fromkeys([*(f"p{q}" for q in PERCENTILES), "mean"])
    if len(values) == 1:
        cuts = [values[0]] * 99
    else:
        cuts = statistics.quantiles(values, n=100, method="inclusive")
    result: dict[str, float | None] = {f"p{q}": cuts[q - 1] for q in PERCENTILES}
    result["mean"] = statistics.fmean(values)
    return result


def tpot_s(result: RequestResult) -> float | None:
    if not result.chunk_times_s or result.output_tokens < 2:
        return None
    return (result.chunk_times_s[-1] - result.chunk_times_s[0]) / (result.output_tokens - 1)


def itl_s(result: RequestResult) -> list[float]:
    gaps: list[float] = []
    times, counts = result.chunk_times_s, result.chunk_num_tokens
    for i in range(1, len(times)):
        gap = times[i] - times[i - 1]
        gaps += [gap / counts[i]] * counts[i]
    return gaps


def meets(result: RequestResult, slo: Slo) -> bool:
    ttft, tpot = result.ttft_s, tpot_s(result)
    if not result.ok or ttft is None or ttft * 1e3 > slo.ttft_ms:
        return False
    return tpot is None or tpot * 1e3 <= slo.tpot_ms


def summarize(results: Sequence[RequestResult], seconds: float, slo: Slo) -> dict[str, Any]:
    """One run's summary (see the module docstring); times in ms."""
    ok = [r for r in results if r.ok]

    def scaled(values: list[float]) -> dict[str, float | None]:
        return percentiles([v * 1e3 for v in values])

    ttfts = [t for r in ok if (t := r.ttft_s) is not None]
    tpots = [t for r in ok if (t := tpot_s(r)) is not None]
    itls = [gap for r in ok for gap in itl_s(r)]
    output = sum(r.output_tokens for r in results)
    good = sum(1 for r in results if meets(r, slo))
    failed = sorted((r for r in results if r.error), key=lambda r: r.sent_s)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "errors": sorted({r.error for r in results if r.error}),
        "num_wrong_token_counts": sum(
            1 for r in results if not r.error and r.output_tokens != r.max_tokens
        ),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in results),
        "output_tokens": output,
        "num_chunks": sum(len(r.chunk_times_s) for r in results),
        "seconds": seconds,
        "requests_per_s": len(ok) / seconds,
        "output_tokens_per_s": output / seconds,
        "mean_concurrency": sum(r.latency_s for r in results) / seconds,
        "ttft_ms": scaled(ttfts),
        "tpot_ms": scaled(tpots),
        "itl_ms": scaled(itls),
        "latency_ms": scaled([r.latency_s for r in ok]),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "num_meeting_slo": good,
        "goodput_requests_per_s": good / seconds,
    }


def ms_cell(values: dict[str, float | None], quantiles: Sequence[str], digits: int) -> str:
    """Percentiles of a summary as a table cell, "-" for none."""
    return " / ".join("-" if values[q] is None else f"{values[q]:.{digits}f}" for q in quantiles)


def failure_note(label: str, summary: dict[str, Any]) -> list[str]:
    """A report line for a run with failed or short requests; none without."""
    failed, short = summary["num_failed"], summary["num_wrong_token_counts"]
    if not failed and not short:
        return []
    parts = []
    if failed:
        parts.append(
            f"{failed} of {summary['num_requests']} requests failed "
            f"(first error: {summary['first_error']})"
        )
    if short:
        parts.append(f"{short} ended without all their tokens")
    return [
        f"- {label}: {'; '.join(parts)}. Its output tok/s counts the tokens received, "
        "its latencies only the finished requests."
    ]


def request_rows(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per request, compact, for the JSON: id, tokens, send/first/end times (s)."""
    return [
        {
            "id": r.request_id,
            "prompt": r.prompt_tokens,
            "cached": r.cached_prompt_tokens,
            "max_tokens": r.max_tokens,
            "output": r.output_tokens,
            "sent_s": round(r.sent_s, 6),
            "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 6),
            "end_s": round(r.end_s, 6),
            "error": r.error,
        }
        for r in results
    ]
