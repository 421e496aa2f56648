"""Each executor's step loop: schedules, sends one step on its stream,
applies the samples and queues the chunks; the executors' loops run
concurrently (one asyncio task each, started by the service). An error in
the scheduler's own code fails the generation it concerns, not the
executor; what ends a loop is handed to the executors' registry
(``executors.py``): the executor is resynced or marked down."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import NamedTuple

from pagedkv.common.step_trace import step_trace
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.executor_client import ExecutorDown
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.executors import Executors
from pagedkv.scheduler.generations import Generations
from pagedkv.scheduler.internal_errors import InternalErrors
from pagedkv.scheduler.metrics import SchedulerMetrics
from pagedkv.scheduler.sequence import Generation
from pagedkv.scheduler.takeover import owner_if_fenced
from pagedkv.v1 import executor_pb2

# A step's record in a step trace (pagedkv.common.step_trace): perf_counter
# times when its scheduling started and ended, its send returned, its
# response came and was applied.
TRACE_FIELDS = (
    "step_id",
    "entries",
    "tokens",
    "num_steps",
    "scheduling",
    "scheduled",
    "sent",
    "received",
    "processed",
    "cpu",
)


class StepTiming(NamedTuple):
    """Where one step's time went (seconds), for benchmarks."""

    executor: str
    num_entries: int
    num_tokens: int
    schedule_s: float  # building the step message (scheduler CPU)
    rpc_s: float  # from sending to having the response (others' steps included when pipelined)
    executor_host_s: float  # the executor's own time for the step (its report)
    process_s: float  # applying the samples and queuing chunks (scheduler CPU)


class Resync(Exception):
    """The executor's accounting must be rebuilt (raised inside its loop)."""


class StepLoops:
    """Runs the executors' step loops. Owns the step timings and the step
    trace; changes an executor's state only through its ``ExecutorScheduler``
    and the registry's methods, and generations only through ``Generations``."""

    def __init__(
        self,
        config: SchedulerConfig,
        executors: Executors,
        generations: Generations,
        errors: InternalErrors,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.config = config
        self.executors = executors
        self.generations = generations
        self.errors = errors
        self.metrics = metrics
        self.step_timings: deque[StepTiming] = deque(maxlen=100_000)
        self.trace = step_trace("scheduler", TRACE_FIELDS)  # None unless measuring

    async def run(self, address: str) -> None:
        """Steps the executor until it is down; contains the scheduler's own
        errors (``_contain``)."""
        schedulers = self.executors.schedulers
        while address in schedulers:
            scheduler = schedulers[address]
            try:
                await self._step_loop(scheduler)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if scheduler.released or schedulers.get(address) is not scheduler:
                    # given up, or out of service already: nothing to contain
                    scheduler.loop_ended()
                    return
                if not await self._contain(address, scheduler, exc):
                    return
            else:
                scheduler.loop_ended()  # given up
                return

    async def _contain(self, address: str, scheduler: ExecutorScheduler, exc: Exception) -> bool:
        """Handles what ended an executor's step loop: the executor down by
        cause, or resynced after the scheduler's own error (whose culprit
        fails); False when the executor is out of service now."""
        executors = self.executors
        if isinstance(exc, ExecutorDown):
            owner = None
            if exc.cause != "timeout":
                owner = await owner_if_fenced(executors.clients[address])
            if owner is not None:
                executors.executor_down(address, f"fenced: {owner}", "fenced")
                return False
            if exc.cause != "refused":
                executors.executor_down(address, str(exc), exc.cause)
                return False
            # It refused what we sent: the message was wrong, our bug.
            self.errors.report(exc, "step refused", executor=address)
            executors.unattributed_error(scheduler)
        elif not isinstance(exc, Resync):
            error = self.errors.report(exc, "step loop", executor=address)
            culprit = scheduler.current
            if culprit is None:
                executors.unattributed_error(scheduler)
            else:
                self.generations.fail(culprit.generation, error)
        return await executors.resync(address)

    async def _step_loop(self, scheduler: ExecutorScheduler) -> None:
        """Async stepping: step N + 1 is built and sent while the executor
        runs step N, so scheduling overlaps the executor's work; at most
        ``config.pipeline_depth`` steps are in flight. Raises ExecutorDown,
        Resync, or the scheduler's own errors."""
        executors = self.executors
        schedulers = executors.schedulers
        address = scheduler.address
        client = executors.clients[address]
        wake = executors.wake[address]
        clock = time.perf_counter
        # A step in flight: when it was scheduled from, to, sent (monotonic),
        # and when its send returned.
        inflight: deque[tuple[ScheduledStep, float, float, float, float]] = deque()
        trace = self.trace
        depth = self.config.pipeline_depth
        cluster = executors.cluster
        # The oldest step's answer while it is being read (see below).
        receiving: asyncio.Future[executor_pb2.StepResponse] | None = None
        try:
            while True:
                if scheduler.released and not inflight:
                    return
                if schedulers.get(address) is not scheduler and not scheduler.released:
                    return  # out of service (marked down elsewhere): steps in flight are moot
                if executors.must_resync(address):
                    raise Resync
                if cluster is not None and not cluster.may_step(address):
                    await cluster.lease_renewed(address)  # its lease must be renewed first
                    if schedulers.get(address) is not scheduler:
                        return  # the lease was lost: the executor is out of service
                    continue
                if len(inflight) < depth:
                    t0 = clock()
                    step = scheduler.schedule()
                    if step is None and not inflight:  # idle: the host tier's offloads ahead
                        step = scheduler.idle_step()
                    if step is not None:
                        t1 = clock()
                        sent_at = time.monotonic()
                        for early in step.before:  # copy-only messages: no entries
                            await client.send(early)
                            inflight.append((ScheduledStep(early), t0, t1, sent_at, clock()))
                        await client.send(step.request)
                        inflight.append((step, t0, t1, sent_at, clock()))
                        if len(inflight) < depth:
                            continue
                if not inflight:
                    wake.clear()
                    await wake.wait()
                    continue
                if len(inflight) < depth:
                    # Room for another step, and nothing to send now: work that
                    # comes before the answer is scheduled then (pipelined
                    # behind the step in flight), not once the answer is in.
                    if receiving is None:  # the oldest step's answer, read meanwhile
                        receiving = asyncio.ensure_future(client.receive(inflight[0][3]))
                    wake.clear()
                    woken = asyncio.ensure_future(wake.wait())
                    try:
                        await asyncio.wait((receiving, woken), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        woken.cancel()
                    if not receiving.done():
                        continue
                if receiving is None:  # a full pipeline: nothing to do but read it
                    response = await client.receive(inflight[0][3])
                else:
                    try:
                        response = await receiving
                    finally:
                        receiving = None
                sent, t0, t1, sent_at, t_sent = inflight.popleft()
                t2 = clock()
                if response.draining and not scheduler.draining:
                    executors.executor_draining(address, response.drain_seconds_left)
                touched, errors = scheduler.process(sent, response)
                for generation, exc in errors:
                    error = self.errors.report(
                        exc, "process", executor=address, request_id=generation.request_id
                    )
                    self.generations.fail(generation, error)
                if errors and not scheduler.kv.check_integrity().ok:
                    raise Resync
                if not errors:
                    executors.step_succeeded(address)
                self._publish(touched, scheduler, t2 - t0, sent.request.num_decode_steps > 1)
                self.step_timings.append(
                    StepTiming(
                        address,
                        len(sent.num_scheduled),
                        sum(sent.num_scheduled),
                        t1 - t0,
                        t2 - t1,
                        response.host_time_us * 1e-6,
                        clock() - t2,
                    )
                )
                if trace is not None:
                    request = sent.request
                    trace.add(
                        request.step_id,
                        len(sent.num_scheduled),
                        sum(sent.num_scheduled),
                        max(1, request.num_decode_steps),
                        t0,
                        t1,
                        t_sent,
                        t2,
                        clock(),
                        time.process_time(),
                    )
                # No yield here: the next step is scheduled and sent first (the
                # device may be waiting for it); the Generate handlers run while
                # this loop waits for that step's answer.
        finally:
            if receiving is not None:  # the loop ended with an answer unread: moot
                receiving.cancel()
                if receiving.done() and not receiving.cancelled():
                    receiving.exception()  # retrieved: an executor already down

    def _publish(
        self,
        touched: set[Generation],
        scheduler: ExecutorScheduler,
        seconds: float,
        window: bool = False,
    ) -> None:
        """Marks the touched generations' news for their streams and records
        the latency metrics: a step gives each generation one token, a
        decode window (``window``) each plain one its window's tokens, the
        gap spread over them. Generations whose last tokens came in the
        same step have the same gap: each gap is observed once, with its
        count."""
        now = time.monotonic()
        metrics = self.metrics
        address = scheduler.address
        gaps: dict[tuple[float, int], int] = {}  # (last token at, tokens): generations
        retire = self.generations.retire
        for generation in touched:
            last = generation.last_token_at
            if last is None:  # its first token (first_token_at is None too)
                if metrics is not None:
                    metrics.observe_first_token(now - generation.arrival)
                generation.first_token_at = now
            elif metrics is not None:
                count = (generation.window_tokens or 1) if window and generation.plain else 1
                key = (last, count)
                gaps[key] = gaps.get(key, 0) + 1
            generation.last_token_at = now
            try:
                generation.flush()
            except Exception as exc:
                error = self.errors.report(exc, "flush", executor=address)
                self.generations.fail(generation, error)
                continue
            if generation.done:
                retire(generation)
        if metrics is not None:
            for (last, count), num in gaps.items():
                metrics.observe_inter_token(now - last, count, num)
            kv = scheduler.kv
            stats = kv.prefix_cache_stats
            metrics.observe_step(address, seconds)
            metrics.set_kv_usage(address, kv.usage)
            metrics.set_prefix_cache(address, stats.queries, stats.hits)
            if kv.host is not None:
                bytes_per_block = scheduler.info.bytes_per_block
                metrics.host_tier.set(address, kv.host.stats, stats.host_hits, bytes_per_block)
            metrics.set_preemptions(self.executors.num_preemptions)
            metrics.set_queue_sizes(self.executors.num_running, self.executors.num_waiting)
