"""The discrete-event loop: executors stepping, schedulers owning them, one router.

Simulated time advances from event to event (a heap keyed by time, ties in
the order pushed): arrivals from the trace, each executor's step end (its
next step starts at once while it has work), the schedulers' cache-event
flushes and load reports, and optionally a scheduler failure and the
adoption of its executors.

Ownership: scheduler ``s`` of ``num_schedulers`` holds a contiguous share of
the executors. When it fails (``FailurePlan``), its executors have no owner
for ``lease_ttl_s``: the router does not see them, the events it had not
flushed are lost, and the requests they held come back to their clients,
which resume them at once elsewhere (prompt plus the tokens delivered so far,
as a new prompt). Then the surviving schedulers adopt them in turn, each
executor with its tagged blocks (its incarnation and prefix cache survive),
and the router's index of each is resynced from the adopted cache.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.cluster_sim.cost_model import StepCostModel
from pagedkv.bench.cluster_sim.executor import Job, SimExecutor, SimStep, TrackedRequest
from pagedkv.bench.cluster_sim.metrics import (
    FailureSummary,
    Recorder,
    RunSummary,
    hit_rate_between,
    summarize,
    time_series,
)
from pagedkv.bench.cluster_sim.router import SimRouter
from pagedkv.bench.cluster_sim.trace import TraceConfig, TraceRequest, generate
from pagedkv.router.index import PrefixIndex
from pagedkv.router.scoring import RoutingPolicy

_ARRIVAL, _STEP_END, _FLUSH, _REPORT, _FAIL, _ADOPT = range(6)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    num_executors: int = 64
    num_schedulers: int = 8
    num_blocks: int = 8192  # per executor
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    flush_interval_s: float = 0.05  # the prefix mirror's flush
    index_lag_s: float = 0.0  # from a flush to the router's index
    report_interval_s: float = 0.1  # load reports
    lease_ttl_s: float = 3.0
    bin_s: float = 1.0  # time-series bins
    window_s: float = 5.0  # load-spread and failure windows
    model_id: str = "sim"


@dataclass(frozen=True, slots=True)
class FailurePlan:
    at_s: float
    scheduler: int = 0


@dataclass(frozen=True)
class RunResult:
    """One simulated run of one policy."""

    policy: str
    summary: RunSummary
    failure: FailureSummary | None
    series: dict[str, list[Any]]
    integrity_errors: list[str]
    leaked_blocks: int
    index_mismatches: int  # holders whose index entry differs from their pool's cache
    cpu_s: float


class _Loop:
    """One run's state; ``run_cluster`` is its only user."""

    def __init__(
        self,
        config: ClusterConfig,
        trace: TraceConfig,
        policy: RoutingPolicy,
        cost: StepCostModel,
    ) -> None:
        self.config = config
        self.cost = cost
        n = config.num_executors
        self.executors = [
            SimExecutor(
                i,
                f"incarnation-{i:03d}",
                config.num_blocks,
                block_size=config.block_size,
                model_id=config.model_id,
                max_num_seqs=min(config.max_num_seqs, cost.max_batch),
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
            for i in range(n)
        ]
        self.owners: list[int | None] = [i * config.num_schedulers // n for i in range(n)]
        self.router = SimRouter(
            policy,
            incarnation_ids=[e.incarnation_id for e in self.executors],
            model_id=config.model_id,
            block_size=config.block_size,
            index_lag_s=config.index_lag_s,
        )
        for i, owner in enumerate(self.owners):
            self.router.set_owner(i, f"scheduler-{owner}")
        self.recorder = Recorder(config.bin_s)
        self.tracked: list[TrackedRequest] = []
        self.busy: list[SimStep | None] = [None] * n
        self.epochs = [0] * n
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()
        self.arrivals: Iterator[TraceRequest] = generate(trace)
        self.arrivals_done = False
        self.num_unfinished = 0
        self.num_resumed = 0
        self.orphans: list[int] = []
        self.adopted_cached_blocks = 0

    def push(self, at: float, kind: int, arg: int = 0, epoch: int = 0) -> None:
        heapq.heappush(self.heap, (at, next(self.seq), kind, arg, epoch))

    @property
    def running(self) -> bool:
        return not self.arrivals_done or self.num_unfinished > 0

    # -- requests ----------------------------------------------------------------------

    def next_arrival(self) -> None:
        arrival = next(self.arrivals, None)
        if arrival is None:
            self.arrivals_done = True
            return
        self.push(arrival.arrival_s, _ARRIVAL)
        self._pending = arrival

    def arrive(self, now: float) -> None:
        arrival = self._pending
        tracked = TrackedRequest(arrival.request_id, now, len(arrival.prompt_token_ids))
        self.tracked.append(tracked)
        self.num_unfinished += 1
        # The most a prefix cache can hit: the shared prefix's full blocks
        # (never the prompt's last token, whose logits are needed).
        block_size = self.config.block_size
        shareable = min(arrival.prefix_len, len(arrival.prompt_token_ids) - 1)
        self.recorder.num_shareable_tokens += shareable // block_size * block_size
        self.submit(Job(arrival.prompt_token_ids, arrival.num_output_tokens, tracked), now)
        self.next_arrival()

    def submit(self, job: Job, now: float) -> None:
        self.router.apply_due(now)
        executor, _ = self.router.place(job.prompt_token_ids, now)
        job.tracked.executors.append(executor)
        self.executors[executor].submit(job, now)
        if self.busy[executor] is None:
            self.start_step(executor, now)

    # -- steps -------------------------------------------------------------------------

    def start_step(self, i: int, now: float) -> None:
        executor = self.executors[i]
        plan = executor.schedule_step()
        self.router.buffer(i, executor.take_cache_events())
        if plan is None:
            return
        admissions = self.recorder.admissions
        for admission in plan.admissions:
            admissions.append((now, i, admission.num_prompt_tokens, admission.num_cached_tokens))
        self.recorder.on_step(now, plan.num_prefill_tokens, plan.num_preemptions)
        step_s = self.cost.step_s(
            plan.num_prefill_tokens, plan.num_prefill_pairs, plan.decode_context_tokens
        )
        self.busy[i] = plan
        self.push(now + step_s, _STEP_END, i, self.epochs[i])

    def end_step(self, i: int, epoch: int, now: float) -> None:
        plan = self.busy[i]
        if epoch != self.epochs[i] or plan is None:
            return  # its scheduler died while the step was in flight
        self.busy[i] = None
        executor = self.executors[i]
        outcome = executor.finish_step(plan)
        self.recorder.num_output_tokens += len(outcome.sampled)
        for job in outcome.sampled:
            if job.tracked.first_token_s is None:
                job.tracked.first_token_s = now
        for job in outcome.finished:
            job.tracked.finish_s = now
            self.num_unfinished -= 1
        if executor.has_work:
            self.start_step(i, now)

    # -- the control plane -------------------------------------------------------------

    def report(self, now: float) -> None:
        samples: list[int | None] = []
        for i, executor in enumerate(self.executors):
            if self.owners[i] is None:
                samples.append(None)
                continue
            self.router.report(i, executor.num_queued, executor.kv.usage)
            samples.append(executor.num_queued)
        self.recorder.load_times.append(now)
        self.recorder.load_samples.append(samples)

    def fail(self, scheduler: int, now: float) -> None:
        self.orphans = [i for i, owner in enumerate(self.owners) if owner == scheduler]
        jobs: list[Job] = []
        for i in self.orphans:
            self.owners[i] = None
            self.router.set_owner(i, None)
            self.router.drop_buffer(i)
            self.epochs[i] += 1
            self.busy[i] = None
            jobs.extend(self.executors[i].lose_owner())
        for job in jobs:
            tracked = job.tracked
            tracked.num_resumes += 1
            self.num_resumed += 1
            remaining = job.max_tokens - job.num_output_tokens
            self.submit(Job(job.token_ids, max(1, remaining), tracked), now)
        self.push(now + self.config.lease_ttl_s, _ADOPT, scheduler)

    def adopt(self, failed: int, now: float) -> None:
        survivors = [s for s in range(self.config.num_schedulers) if s != failed]
        for k, i in enumerate(self.orphans):
            owner = survivors[k % len(survivors)]
            self.owners[i] = owner
            hashes = self.executors[i].adopt()
            self.adopted_cached_blocks += len(hashes)
            self.router.resync(i, hashes)
            self.router.set_owner(i, f"scheduler-{owner}")
            self.router.report(i, 0, self.executors[i].kv.usage)

    # -- the loop ----------------------------------------------------------------------

    def run(self, failure: FailurePlan | None) -> float:
        """Runs to the last request's end; returns the time of adoption (NaN without)."""
        config = self.config
        self.next_arrival()
        self.push(0.0, _REPORT)
        self.push(config.flush_interval_s, _FLUSH)
        if failure is not None:
            self.push(failure.at_s, _FAIL, failure.scheduler)
        adopted_at = math.nan
        heap = self.heap
        while heap:
            now, _, kind, arg, epoch = heapq.heappop(heap)
            if kind == _STEP_END:
                self.end_step(arg, epoch, now)
            elif kind == _ARRIVAL:
                self.arrive(now)
            elif kind == _FLUSH:
                self.router.flush(now)
                if self.running:
                    self.push(now + config.flush_interval_s, _FLUSH)
            elif kind == _REPORT:
                self.report(now)
                if self.running:
                    self.push(now + config.report_interval_s, _REPORT)
            elif kind == _FAIL:
                self.fail(arg, now)
            elif kind == _ADOPT:
                self.adopt(arg, now)
                adopted_at = now
        # The frees of the last steps (their generated blocks enter the cache
        # then) go out with the next step in the real system: flush them too.
        for i, executor in enumerate(self.executors):
            if self.owners[i] is not None:
                self.router.buffer(i, executor.take_cache_events())
        self.router.flush(math.inf)
        return adopted_at


def _index_follows_pool(index: PrefixIndex, executor: SimExecutor) -> bool:
    """The router's index holds exactly the hashes of the executor's cache."""
    cached = executor.kv.pool.cached_blocks[0]
    holder = executor.incarnation_id
    if index.num_blocks(holder) != len(cached):
        return False
    return all(holder in index.match((block_hash,)) for block_hash in cached)


def run_cluster(
    config: ClusterConfig,
    trace: TraceConfig,
    policy: RoutingPolicy,
    cost: StepCostModel,
    failure: FailurePlan | None = None,
) -> RunResult:
    """Simulates the trace through the cluster with ``policy``, to the last request's end."""
    cpu_start = time.process_time()
    loop = _Loop(config, trace, policy, cost)
    adopted_at = loop.run(failure)
    errors: list[str] = []
    leaked = mismatches = 0
    index = loop.router.index
    for executor in loop.executors:
        report = executor.kv.check_integrity()
        errors += [f"executor {executor.index}: {e}" for e in report.errors]
        leaked += executor.kv.pool.num_blocks - 1 - executor.num_free_blocks()
        if not _index_follows_pool(index, executor):
            mismatches += 1
    errors += [f"index: {e}" for e in index.check_integrity()]
    summary = summarize(
        loop.recorder,
        loop.tracked,
        window_s=config.window_s,
        arrivals_end_s=trace.duration_s,
        num_resumed=loop.num_resumed,
    )
    failure_summary = None
    if failure is not None:
        window = config.window_s
        orphans = set(loop.orphans)
        before = hit_rate_between(loop.recorder, failure.at_s - window, failure.at_s)
        after = hit_rate_between(loop.recorder, adopted_at, adopted_at + window)
        failure_summary = FailureSummary(
            fail_at_s=failure.at_s,
            adopted_at_s=adopted_at,
            window_s=window,
            num_resumed_jobs=loop.num_resumed,
            hit_rate_before=before,
            hit_rate_after=after,
            ratio=after / before if before else math.nan,
            adopted_executors_hit_rate_before=hit_rate_between(
                loop.recorder, failure.at_s - window, failure.at_s, orphans
            ),
            adopted_executors_hit_rate_after=hit_rate_between(
                loop.recorder, adopted_at, adopted_at + window, orphans
            ),
            adopted_cached_blocks=loop.adopted_cached_blocks,
        )
    return RunResult(
        policy=policy.name,
        summary=summary,
        failure=failure_summary,
        series=time_series(loop.recorder, trace.duration_s),
        integrity_errors=errors,
        leaked_blocks=leaked,
        index_mismatches=mismatches,
        cpu_s=time.process_time() - cpu_start,
    )
