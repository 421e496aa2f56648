"""What a simulation run measured, and its summary.

``Recorder`` is written by the cluster loop as things happen: every first
admission of a job with its prefix-cache hit, every step's prefill tokens,
and every load report's queued sequences per executor (None while an
executor has no owner). ``summarize`` turns it and the trace requests into
a ``RunSummary`` (whole run), a ``FailureSummary`` (windows around a
scheduler failure) and per-bin time series for the plots.

Definitions: hit rate = cached prompt tokens / prompt tokens over first
admissions; prefill tokens = tokens computed in prefill chunks (recomputation
after a preemption included); TTFT = a trace request's arrival to its first
token; load spread = max over executors of the time-mean queued sequences
divided by the mean over executors (owned executors only), over the run and
over each ``window_s`` window (the worst is reported).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.bench.cluster_sim.executor import TrackedRequest


@dataclass(slots=True)
class Recorder:
    """Appended to by the cluster loop; read by ``summarize``."""

    bin_s: float
    admissions: list[tuple[float, int, int, int]] = field(default_factory=list)
    # (time, executor, prompt tokens, cached tokens)
    prefill_by_bin: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_shareable_tokens: int = 0  # trace prompts' tokens in full shared-prefix blocks
    load_times: list[float] = field(default_factory=list)
    load_samples: list[list[int | None]] = field(default_factory=list)

    def on_step(self, now: float, num_prefill_tokens: int, num_preemptions: int) -> None:
        self.num_steps += 1
        self.num_preemptions += num_preemptions
        if num_prefill_tokens:
            self.num_prefill_tokens += num_prefill_tokens
            b = int(now / self.bin_s)
            bins = self.prefill_by_bin
            if b >= len(bins):
                bins.extend([0] * (b + 1 - len(bins)))
            bins[b] += num_prefill_tokens


@dataclass(frozen=True, slots=True)
class RunSummary:
    num_requests: int
    num_finished: int
    num_resumed_jobs: int
    num_prompt_tokens: int
    num_cached_tokens: int
    hit_rate: float
    hit_rate_ceiling: float  # shared-prefix tokens in full blocks / trace prompt tokens
    num_prefill_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    num_output_tokens: int
    makespan_s: float
    output_tokens_per_s: float
    load_spread: float
    load_spread_worst_window: float
    worst_window_start_s: float
    mean_queued: float
    num_preemptions: int
    num_steps: int


@dataclass(frozen=True, slots=True)
class FailureSummary:
    fail_at_s: float
    adopted_at_s: float
    window_s: float
    num_resumed_jobs: int
    hit_rate_before: float
    hit_rate_after: float
    ratio: float
    adopted_executors_hit_rate_before: float
    adopted_executors_hit_rate_after: float
    adopted_cached_blocks: int


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def hit_rate_between(
    recorder: Recorder, start: float, end: float, executors: set[int] | None = None
) -> float:
    """Cached / prompt tokens of first admissions in ``[start, end)``."""
    prompt = cached = 0
    for t, executor, num_prompt, num_cached in recorder.admissions:
        if start <= t < end and (executors is None or executor in executors):
            prompt += num_prompt
            cached += num_cached
    return cached / prompt if prompt else float("nan")


def _spread(samples: np.ndarray) -> float:
    """max / mean of per-executor time means; NaN samples are unowned."""
    owned = ~np.isnan(samples).all(axis=0)
    if not owned.any():
        return float("nan")
    means = np.nanmean(samples[:, owned], axis=0)
    mean = float(means.mean())
    return float(means.max()) / mean if mean > 0 else 1.0


def _load_matrix(recorder: Recorder) -> np.ndarray:
    return np.array(
        [[np.nan if q is None else q for q in row] for row in recorder.load_samples], float
    ).reshape(len(recorder.load_samples), -1)


def summarize(
    recorder: Recorder,
    tracked: Sequence[TrackedRequest],
    *,
    window_s: float,
    arrivals_end_s: float,
    num_resumed: int,
) -> RunSummary:
    """The run's summary; load figures cover the arrival period only (while the
    cluster drains at the end, a few executors finishing the last requests
    would say nothing about placement)."""
    ttfts = [r.first_token_s - r.arrival_s for r in tracked if r.first_token_s is not None]
    finishes = [r.finish_s for r in tracked if r.finish_s is not None]
    makespan = max(finishes, default=0.0)
    trace_prompt = sum(r.num_prompt_tokens for r in tracked)
    prompt = sum(a[2] for a in recorder.admissions)
    cached = sum(a[3] for a in recorder.admissions)
    times = np.array(recorder.load_times)
    loads = _load_matrix(recorder)[times < arrivals_end_s]
    times = times[times < arrivals_end_s]
    worst, worst_start = float("nan"), 0.0
    start = 0.0
    while start + window_s <= arrivals_end_s + 1e-9:
        rows = (times >= start) & (times < start + window_s)
        if rows.any():
            spread = _spread(loads[rows])
            if not spread <= worst:
                worst, worst_start = spread, start
        start += window_s
    return RunSummary(
        num_requests=len(tracked),
        num_finished=len(finishes),
        num_resumed_jobs=num_resumed,
        num_prompt_tokens=prompt,
        num_cached_tokens=cached,
        hit_rate=cached / prompt if prompt else float("nan"),
        hit_rate_ceiling=recorder.num_shareable_tokens / trace_prompt if trace_prompt else 0.0,
        num_prefill_tokens=recorder.num_prefill_tokens,
        ttft_p50_s=_percentile(ttfts, 50),
        ttft_p99_s=_percentile(ttfts, 99),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else float("nan"),
        num_output_tokens=recorder.num_output_tokens,
        makespan_s=makespan,
        output_tokens_per_s=recorder.num_output_tokens / makespan if makespan else 0.0,
        load_spread=_spread(loads) if len(loads) else float("nan"),
        load_spread_worst_window=worst,
        worst_window_start_s=worst_start,
        mean_queued=float(np.nanmean(loads)) if len(loads) else 0.0,
        num_preemptions=recorder.num_preemptions,
        num_steps=recorder.num_steps,
    )


def time_series(recorder: Recorder, end_s: float) -> dict[str, list[Any]]:
    """Per ``bin_s`` bin up to ``end_s``: hit rate, prefill tokens/s, load
    spread, mean queued."""
    bin_s = recorder.bin_s
    num_bins = max(1, math.ceil(end_s / bin_s))
    prompt = np.zeros(num_bins)
    cached = np.zeros(num_bins)
    for t, _, num_prompt, num_cached in recorder.admissions:
        b = int(t / bin_s)
        if b >= num_bins:
            continue
        prompt[b] += num_prompt
        cached[b] += num_cached
    prefill = np.zeros(num_bins)
    n = min(num_bins, len(recorder.prefill_by_bin))
    prefill[:n] = recorder.prefill_by_bin[:n]
    loads = _load_matrix(recorder)
    times = np.array(recorder.load_times)
    spread, queued = [], []
    for b in range(num_bins):
        rows = (times >= b * bin_s) & (times < (b + 1) * bin_s)
        has = bool(rows.any())
        spread.append(_spread(loads[rows]) if has else None)
        queued.append(float(np.nanmean(loads[rows])) if has else None)
    return {
        "t_s": [round(b * bin_s, 6) for b in range(num_bins)],
        "hit_rate": [
            round(c / p, 4) if p else None
            for c, p in zip(cached.tolist(), prompt.tolist(), strict=True)
        ],
        "prefill_tokens_per_s": [round(v / bin_s, 1) for v in prefill.tolist()],
        "load_spread": [None if s is None or s != s else round(s, 4) for s in spread],
        "mean_queued": [None if q is None else round(q, 3) for q in queued],
    }
