"""The scheduler service: generations in, steps out to every executor, chunks
back to the Generate streams. One asyncio loop; text prompts are encoded on
worker threads (``pagedkv.common.text_prompts``) so that no prompt can stall it.

Each executor has a step loop (a task) that schedules, sends one step on its
stream, applies the samples and queues chunks; the executors' loops run
concurrently. A generation is placed on one executor when it arrives: the
longest cached prefix, then the most free blocks.

An error in the scheduler's own code fails the generation it concerns, not
the executor; executors lost and taken back: ``failover.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from pagedkv.common.errors import (
    AlreadyExists,
    InvalidArgument,
    ServiceError,
    Unavailable,
)
from pagedkv.common.ids import MAX_REQUEST_ID_BYTES
from pagedkv.common.logging import get_logger
from pagedkv.common.loop_lag import LoopLag
from pagedkv.common.step_trace import step_trace
from pagedkv.common.text import TextTokenizer
from pagedkv.common.text_prompts import PromptEncoder
from pagedkv.scheduler.cluster import ClusterMember
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.executor_client import ExecutorClient, ExecutorDown
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.failover import ExecutorFailover, Resync
from pagedkv.scheduler.metrics import SchedulerMetrics
from pagedkv.scheduler.placement import new_generation, place
from pagedkv.scheduler.sequence import FinishReason, Generation
from pagedkv.scheduler.takeover import TakenOver
from pagedkv.scheduler.validation import prompt_token_ids
from pagedkv.v1 import scheduler_pb2

__all__ = ["SchedulerConfig", "SchedulerService", "StepTiming"]

log = get_logger(__name__)


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


class SchedulerService(ExecutorFailover):
    """Owns the executors, the generations and their step loops."""

    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics | None = None) -> None:
        super().__init__(config, metrics)
        self.tokenizer: TextTokenizer | None = None
        self.prompts = PromptEncoder()  # text prompts, encoded off the loop
        self.loop_lag = LoopLag(metrics.observe_loop_lag) if metrics is not None else None
        self._keys = itertools.count(1)  # generations' serial numbers
        self.step_timings: deque[StepTiming] = deque(maxlen=100_000)
        self.trace = step_trace("scheduler", TRACE_FIELDS)  # None unless measuring
        self.draining = False  # shutting down: nothing new is admitted
        # Awaited when draining starts (the server turns its health NOT_SERVING).
        self.on_draining: list[Callable[[], Awaitable[None]]] = []

    # -- life -----------------------------------------------------------------

    async def start(self) -> None:
        """Takes over every executor that answers (the others are probed
        until they do); raises Unavailable if none does. In a cluster, joins
        it instead and claims its share of the registered executors (maybe
        none yet). Measures the event loop's lag into the metrics, if any."""
        if self.loop_lag is not None:
            self.loop_lag.start()
        if self.config.cluster is not None:
            self.cluster = ClusterMember(self, self.config.cluster)
            if self.metrics is not None:
                self.metrics.watch_cluster(self.cluster)
            await self.cluster.start()
            return
        for address in self.config.executors:
            client = self.new_client(address)
            self.clients[address] = client
            try:
                taken = await self.take_over(client)
            except ExecutorDown as exc:
                self.down[address] = str(exc)
                log.warning("executor down at start", executor=address, error=str(exc))
                continue
            info = taken.info
            if self.schedulers and info.model_id != self.info.model_id:
                raise ValueError(
                    f"executor {address} serves {info.model_id!r}, not {self.info.model_id!r}"
                )
            self.info = info
            self._adopt(address, client, taken)
        if not self.schedulers:
            raise Unavailable("no executor answered: " + "; ".join(self.down.values()))
        self.tokenizer = TextTokenizer.from_model_dir(self.config.model_dir or self.info.model_id)
        for address in self.schedulers:
            self._spawn(self._loop(address))
        for address in self.down:
            self._spawn(self._recover(address))

    def adopt_claimed(self, address: str, client: ExecutorClient, taken: TakenOver) -> None:
        """Puts an executor the cluster member just claimed in service (the
        first one also sets the model and the tokenizer)."""
        if not self.info.model_id:
            self.info = taken.info
            self.tokenizer = TextTokenizer.from_model_dir(
                self.config.model_dir or self.info.model_id
            )
        self._adopt(address, client, taken)
        self._spawn(self._loop(address))

    def lose_executor(self, address: str, why: str) -> None:
        """Its lease was lost: the executor leaves service here at once (its
        sequences are recomputed elsewhere) and is forgotten."""
        if address in self.schedulers:
            self._executor_down(address, f"fenced: {why}", "fenced")
        elif address in self.clients:
            self._spawn(self.forget(address))

    def executor_ended(self, address: str, why: str) -> None:
        """The incarnation in service ended (the cluster registry says so and
        it does not answer as itself): down like a broken connection, so its
        sequences move and it is probed (``why`` starts with the cause)."""
        if address in self.schedulers:
            self._executor_down(address, why, "transport")

    async def shutdown(self, drain_timeout: float) -> None:
        """A graceful stop (SIGTERM): health turns NOT_SERVING (the
        ``on_draining`` hooks), new requests get UNAVAILABLE, waiting
        ones are handed back at once (their streams end with UNAVAILABLE and
        no final chunk: a client resumes them elsewhere), running ones get
        ``drain_timeout`` seconds to finish, then are handed back too; in a
        cluster the executors are then released for the other members."""
        self.draining = True
        for hook in self.on_draining:
            await hook()
        log.info("scheduler draining", running=self.num_running, waiting=self.num_waiting)
        why = "the scheduler is stopping; resume on another replica"
        for scheduler in list(self.schedulers.values()):
            scheduler.start_draining()
            for seq in list(scheduler.waiting):
                if seq.row is None and not seq.generation.done:
                    self._hand_back(seq.generation, Unavailable(why))
        if self.cluster is not None:
            await self.cluster.leave(drain_timeout)
        else:
            deadline = time.monotonic() + drain_timeout
            while self.num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        for generation in list(self.generations.values()):
            self._hand_back(generation, Unavailable(why))
        await self.stop()

    async def stop(self) -> None:
        """Ends every live generation (ABORT) and closes the executors."""
        for generation in list(self.generations.values()):
            self.abort(generation.request_id)
        pending = set(self._tasks)
        for _ in range(5):  # a cancellation can be lost in a race with a result
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        for client in self.clients.values():
            await client.close()
        self.prompts.close()
        if self.loop_lag is not None:
            await self.loop_lag.stop()
        if self.cluster is not None and not self.cluster.leaving:
            await self.cluster.close()

    # -- requests -------------------------------------------------------------

    async def encode_text(self, request: scheduler_pb2.GenerateRequest) -> list[int] | None:
        """The token ids of a text prompt, encoded off the event loop (text
        too long to fit the model is refused before: ``pagedkv.common.text_prompts``);
        None for token ids, or when the model has no tokenizer (``submit``
        refuses that). Raises the service errors ``submit`` would raise first."""
        if request.WhichOneof("prompt") != "text" or self.tokenizer is None:
            return None
        self._check_open()
        try:
            return await self.prompts.encode(request.text, self.tokenizer, self.info.max_model_len)
        except ServiceError:
            raise
        except Exception as exc:
            raise self.internal_error(exc, "encode", request_id=request.request_id) from exc

    def submit(
        self, request: scheduler_pb2.GenerateRequest, text_ids: list[int] | None = None
    ) -> Generation:
        """Validates a Generate call and queues it; raises the service errors
        (an error in the scheduler's own code: INTERNAL, nothing queued). A
        text prompt's ids are ``text_ids``, from ``encode_text``."""
        try:
            return self._submit(request, text_ids)
        except ServiceError:
            raise
        except Exception as exc:
            raise self.internal_error(exc, "submit", request_id=request.request_id) from exc

    def _check_open(self) -> None:
        """Unavailable while draining or with no executor in service."""
        if self.draining:
            raise Unavailable("the scheduler is stopping; send the request to another replica")
        if not self.schedulers:
            raise Unavailable("no executor is available: " + "; ".join(self.down.values()))

    def _submit(
        self, request: scheduler_pb2.GenerateRequest, text_ids: list[int] | None
    ) -> Generation:
        self._check_open()
        request_id = request.request_id or uuid.uuid4().hex
        size = len(request_id.encode())
        if size > MAX_REQUEST_ID_BYTES:
            raise InvalidArgument(
                f"request_id: {size} bytes; at most {MAX_REQUEST_ID_BYTES} bytes of UTF-8"
            )
        if request_id in self.generations:
            raise AlreadyExists(f"request_id: {request_id!r} is live")
        size = len(request.preferred_executor.encode())
        if size > MAX_REQUEST_ID_BYTES:
            raise InvalidArgument(
                f"preferred_executor: {size} bytes; an executor address has at most "
                f"{MAX_REQUEST_ID_BYTES}"
            )
        prompt = prompt_token_ids(request, text_ids, self.info.vocab_size)
        tokenizer = None if request.skip_text else self.tokenizer  # skip_text: no text made
        generation = new_generation(
            request_id, prompt, request, self.info, tokenizer, self.schedulers, next(self._keys)
        )
        executor, hint = place(self.schedulers, generation, request.preferred_executor)
        generation.placement = scheduler_pb2.Placement(executor=executor, hint=hint)
        if self.metrics is not None:
            self.metrics.count_placement_hint(hint)
        self.generations[request_id] = generation
        self.schedulers[executor].add(generation.sequences[0])
        self._wake[executor].set()
        if self.metrics is not None:
            self.metrics.count_tokens(prompt=len(prompt), generated=0)
        log.info(
            "request queued",
            request_id=request_id,
            executor=executor,
            prompt_tokens=len(prompt),
            resumed_tokens=len(request.resumed_token_ids),
            max_tokens=generation.max_tokens,
            n=generation.n,
            beam_width=generation.beam.width if generation.beam else 0,
        )
        return generation

    def abort(self, request_id: str) -> bool:
        """Ends a live generation with FINISH_REASON_ABORT and frees its blocks."""
        generation = self.generations.pop(request_id, None)
        if generation is None:
            return False
        ended = [seq for seq in generation.sequences if not seq.finished]
        for seq in ended:  # all finished first: the last release returns reserved rows
            seq.finish(FinishReason.FINISH_REASON_ABORT)
        for seq in ended:
            scheduler = self.schedulers.get(seq.executor or "")
            if scheduler is None:
                continue
            try:
                scheduler.release(seq)
            except Exception as exc:  # its executor's accounting is in doubt
                self.internal_error(exc, "abort", request_id=request_id)
                self._resync.add(scheduler.address)
            self._wake[scheduler.address].set()
        self._end(generation)
        return True

    # -- the step loops -------------------------------------------------------

    async def _loop(self, address: str) -> None:
        """Steps the executor until it is down; contains the scheduler's own
        errors (see failover.py)."""
        while address in self.schedulers:
            scheduler = self.schedulers[address]
            try:
                await self._step_loop(scheduler)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if scheduler.released or self.schedulers.get(address) is not scheduler:
                    # given up, or out of service already: nothing to contain
                    scheduler.loop_ended()
                    return
                if not await self._contain(address, scheduler, exc):
                    return
            else:
                scheduler.loop_ended()  # given up
                return

    async def _contain(self, address: str, scheduler: ExecutorScheduler, exc: Exception) -> bool:
        """Handles what ended an executor's step loop (see failover.py);
        False when the executor is out of service now."""
        if isinstance(exc, ExecutorDown):
            owner = None if exc.cause == "timeout" else await self._owner_if_fenced(address)
            if owner is not None:
                self._executor_down(address, f"fenced: {owner}", "fenced")
                return False
            if exc.cause != "refused":
                self._executor_down(address, str(exc), exc.cause)
                return False
            # It refused what we sent: the message was wrong, our bug.
            self.internal_error(exc, "step refused", executor=address)
            self._unattributed_error(scheduler)
        elif not isinstance(exc, Resync):
            error = self.internal_error(exc, "step loop", executor=address)
            culprit = scheduler.current
            if culprit is None:
                self._unattributed_error(scheduler)
            else:
                self._fail(culprit.generation, error)
        return await self._resync_executor(address)

    async def _step_loop(self, scheduler: ExecutorScheduler) -> None:
        """Async stepping: step N + 1 is built and sent while the executor
        runs step N, so scheduling overlaps the executor's work; at most
        ``config.pipeline_depth`` steps are in flight. Raises ExecutorDown,
        Resync, or the scheduler's own errors."""
        address = scheduler.address
        client = self.clients[address]
        wake = self._wake[address]
        clock = time.perf_counter
        # A step in flight: when it was scheduled from, to, sent (monotonic),
        # and when its send returned.
        inflight: deque[tuple[ScheduledStep, float, float, float, float]] = deque()
        trace = self.trace
        depth = self.config.pipeline_depth
        cluster = self.cluster
        while True:
            if scheduler.released and not inflight:
                return
            if self.schedulers.get(address) is not scheduler and not scheduler.released:
                return  # out of service (marked down elsewhere): steps in flight are moot
            if address in self._resync:
                raise Resync
            if cluster is not None and not cluster.may_step(address):
                await cluster.lease_renewed(address)  # its lease must be renewed first
                if self.schedulers.get(address) is not scheduler:
                    return  # the lease was lost: the executor is out of service
                continue
            if len(inflight) < depth:
                t0 = clock()
                step = scheduler.schedule()
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
            sent, t0, t1, sent_at, t_sent = inflight.popleft()
            response = await client.receive(sent_at)
            t2 = clock()
            if response.draining and not scheduler.draining:
                self.executor_draining(address, response.drain_seconds_left)
            touched, errors = scheduler.process(sent, response)
            for generation, exc in errors:
                error = self.internal_error(
                    exc, "process", executor=address, request_id=generation.request_id
                )
                self._fail(generation, error)
            if errors and not scheduler.kv.check_integrity().ok:
                raise Resync
            if not errors:
                self._unattributed.pop(address, None)
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
            await asyncio.sleep(0)  # let Generate handlers run between steps

    def _publish(
        self,
        touched: set[Generation],
        scheduler: ExecutorScheduler,
        seconds: float,
        window: bool = False,
    ) -> None:
        """Queues the touched generations' chunks and records the latency
        metrics: a step gives each generation one token, a decode window
        (``window``) each plain one up to its steps, the gap spread over
        them."""
        now = time.monotonic()
        metrics = self.metrics
        address = scheduler.address
        for generation in touched:
            if metrics is not None:
                if generation.first_token_at is None:
                    metrics.observe_first_token(now - generation.arrival)
                elif generation.last_token_at is not None:
                    count = 1
                    if window and generation.plain:
                        count = max(1, len(generation.sequences[0].pending_token_ids))
                    metrics.observe_inter_token(now - generation.last_token_at, count)
            if generation.first_token_at is None:
                generation.first_token_at = now
            generation.last_token_at = now
            try:
                generation.flush()
            except Exception as exc:
                self._fail(generation, self.internal_error(exc, "flush", executor=address))
                continue
            if generation.done and self.generations.get(generation.request_id) is generation:
                del self.generations[generation.request_id]
                self._count_finished(generation)
        if metrics is not None:
            kv = scheduler.kv
            stats = kv.prefix_cache_stats
            metrics.observe_step(address, seconds)
            metrics.set_kv_usage(address, kv.usage)
            metrics.set_prefix_cache(address, stats.queries, stats.hits)
            metrics.set_preemptions(self.num_preemptions)
            metrics.set_queue_sizes(self.num_running, self.num_waiting)

    # -- stats ----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(len(s.running) for s in self.schedulers.values())

    @property
    def num_waiting(self) -> int:
        return sum(len(s.waiting) for s in self.schedulers.values())

    @property
    def num_preemptions(self) -> int:
        return self._preemptions_of_down + sum(s.num_preemptions for s in self.schedulers.values())

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        response = scheduler_pb2.GetStatsResponse(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preemptions=self.num_preemptions,
            scheduler_id=self.scheduler_id,
        )
        problems = []
        response.num_internal_errors = self.num_internal_errors
        for address, client in self.clients.items():
            scheduler = self.schedulers.get(address)
            executor = response.executors.add(
                address=address,
                healthy=scheduler is not None,
                down_reason=self.down.get(address, ""),
                num_recoveries=self.recoveries.get(address, 0),
            )
            if scheduler is None:
                continue
            kv = scheduler.kv
            prefix = kv.prefix_cache_stats
            executor.suspect = client.suspect
            executor.num_blocks = scheduler.info.num_blocks
            executor.num_usable_blocks = scheduler.info.num_blocks - 1
            executor.num_free_blocks = kv.pool.get_num_free_blocks()
            executor.kv_cache_usage = kv.usage
            executor.prefix_cache_queries = prefix.queries
            executor.prefix_cache_hits = prefix.hits
            executor.incarnation_id = scheduler.info.incarnation_id
            executor.epoch = client.owner.epoch
            executor.num_adopted_cached_blocks = scheduler.num_adopted_cached_blocks
            executor.draining = scheduler.draining
            report = kv.check_integrity()
            if not report.ok:
                problems.append(f"{address}: " + "; ".join(report.errors))
        response.integrity.ok = not problems
        response.integrity.message = "\n".join(problems)
        response.draining = self.draining
        if self.cluster is not None:
            response.cluster.CopyFrom(self.cluster.view)
        return response
