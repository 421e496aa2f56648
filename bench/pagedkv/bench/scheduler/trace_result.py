"""What one run of ``pagedkv bench blocks`` measured (``TraceResult``), and
how a run's per-step records become one."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pagedkv.scheduler.kv_cache_manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class TraceResult:
    num_steps: int
    total_s: float
    us_per_step_mean: float
    us_per_step_median: float
    us_per_step_p99: float
    ns_per_running_request_per_step: float
    mean_running: float
    prefix_hit_rate: float
    prefix_hit_tokens: int
    prefix_query_tokens: int
    block_utilisation_mean: float
    block_utilisation_peak: float
    num_preemptions: int
    num_finished: int
    num_output_tokens: int
    leaked_blocks: int
    integrity_ok: bool
    request_creation_us_mean: float


@dataclass(slots=True)
class StepRecords:
    """Per step of a run: its time, its running requests and the pool's use
    after it (the fraction of usable blocks not free)."""

    step_ns: list[int]
    num_running: list[int]
    usage: list[float]

    @classmethod
    def empty(cls) -> StepRecords:
        return cls([], [], [])


def trace_result(
    records: StepRecords,
    kv: KVCacheManager,
    *,
    num_preemptions: int,
    num_finished: int,
    num_output_tokens: int,
    creation_s: float,
    num_requests: int,
) -> TraceResult:
    """The run's figures from its step records and its block core at the end
    (prefix-cache statistics, integrity, blocks not back in the pool)."""
    step_ns = records.step_ns
    report = kv.check_integrity()
    stats = kv.prefix_cache_stats
    pool = kv.pool
    total_ns = sum(step_ns)
    step_us = sorted(ns / 1000 for ns in step_ns)
    return TraceResult(
        num_steps=len(step_ns),
        total_s=total_ns / 1e9,
        us_per_step_mean=total_ns / len(step_ns) / 1000,
        us_per_step_median=statistics.median(step_us),
        us_per_step_p99=step_us[min(len(step_us) - 1, int(0.99 * len(step_us)))],
        ns_per_running_request_per_step=total_ns / sum(records.num_running),
        mean_running=statistics.fmean(records.num_running),
        prefix_hit_rate=stats.hit_rate,
        prefix_hit_tokens=stats.hits,
        prefix_query_tokens=stats.queries,
        block_utilisation_mean=statistics.fmean(records.usage),
        block_utilisation_peak=max(records.usage),
        num_preemptions=num_preemptions,
        num_finished=num_finished,
        num_output_tokens=num_output_tokens,
        leaked_blocks=pool.num_blocks - 1 - pool.get_num_free_blocks(),
        integrity_ok=report.ok,
        request_creation_us_mean=creation_s / num_requests * 1e6,
    )
