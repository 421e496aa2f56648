"""The scheduler service: generations in, steps out to every executor, chunks
back to the Generate streams. One asyncio loop; no threads.

Each executor has a step loop (a task) that schedules, sends one step on its
stream, applies the samples and queues chunks; the executors' loops run
concurrently. A generation is placed on one executor when it arrives: the
longest cached prefix, then the most free blocks. An executor that fails or
times out is marked down and its sequences are recomputed elsewhere, or end
with FINISH_REASON_ERROR and UNAVAILABLE when no executor is left.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.common.errors import (
    AlreadyExists,
    ResourceExhausted,
    Unavailable,
)
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.executor_client import ExecutorClient, ExecutorDown
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.metrics import SchedulerMetrics
from pagedkv.scheduler.sequence import FinishReason, Generation, Sequence
from pagedkv.scheduler.text import IncrementalDetokenizer, TextTokenizer
from pagedkv.scheduler.validation import prompt_token_ids, validate_sampling
from pagedkv.v1 import executor_pb2, scheduler_pb2

log = get_logger(__name__)


class StepTiming(NamedTuple):
    """Where one step's time went (seconds), for benchmarks."""

    executor: str
    num_entries: int
    num_tokens: int
    schedule_s: float  # building the step message (scheduler CPU)
    rpc_s: float  # from sending to having the response (others' steps included when pipelined)
    executor_host_s: float  # the executor's own time for the step (its report)
    process_s: float  # applying the samples and queuing chunks (scheduler CPU)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    executors: tuple[str, ...]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    executor_timeout: float = 120.0
    model_dir: str | None = None  # for the tokenizer; default: the executors' model id
    scheduler_id: str = ""
    pipeline_depth: int = 2  # steps in flight per executor (1: no async stepping)


class SchedulerService:
    """Owns the executors, the generations and their step loops."""

    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics | None = None) -> None:
        self.config = config
        self.scheduler_id = config.scheduler_id or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.metrics = metrics
        self.clients: dict[str, ExecutorClient] = {}
        self.schedulers: dict[str, ExecutorScheduler] = {}
        self.down: dict[str, str] = {}  # address -> why
        self.generations: dict[str, Generation] = {}
        self.tokenizer: TextTokenizer | None = None
        self.info = executor_pb2.GetInfoResponse()
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._preemptions_of_down = 0  # preemptions on executors now down
        self.step_timings: deque[StepTiming] = deque(maxlen=100_000)

    # -- life -----------------------------------------------------------------

    async def start(self) -> None:
        """Takes over every executor that answers; raises Unavailable if none does."""
        for address in self.config.executors:
            client = ExecutorClient(
                address, self.scheduler_id, timeout=self.config.executor_timeout
            )
            self.clients[address] = client
            try:
                info = await client.connect()
            except ExecutorDown as exc:
                self.down[address] = str(exc)
                log.warning("executor down at start", executor=address, error=str(exc))
                continue
            if self.schedulers and info.model_id != self.info.model_id:
                raise ValueError(
                    f"executor {address} serves {info.model_id!r}, not {self.info.model_id!r}"
                )
            self.info = info
            self.schedulers[address] = ExecutorScheduler(
                address,
                info,
                client.owner,
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
            )
            self._wake[address] = asyncio.Event()
            log.info(
                "executor taken over",
                executor=address,
                epoch=client.owner.epoch,
                num_blocks=info.num_blocks,
            )
        if not self.schedulers:
            raise Unavailable("no executor answered: " + "; ".join(self.down.values()))
        self.tokenizer = TextTokenizer.from_model_dir(self.config.model_dir or self.info.model_id)
        for address in self.schedulers:
            self._tasks.append(asyncio.create_task(self._loop(address)))

    async def stop(self) -> None:
        """Ends every live generation (ABORT) and closes the executors."""
        for generation in list(self.generations.values()):
            self.abort(generation.request_id)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self.clients.values():
            await client.close()

    # -- requests -------------------------------------------------------------

    def submit(self, request: scheduler_pb2.GenerateRequest) -> Generation:
        """Validates a Generate call and queues it; raises the service errors."""
        if not self.schedulers:
            raise Unavailable("no executor is available")
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.generations:
            raise AlreadyExists(f"request_id: {request_id!r} is live")
        prompt = prompt_token_ids(request, self.tokenizer, self.info.vocab_size)
        generation = self._generation(request_id, prompt, request)
        executor = self._place(generation)
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
            max_tokens=generation.max_tokens,
            n=generation.n,
            beam_width=generation.beam.width if generation.beam else 0,
        )
        return generation

    def _generation(
        self, request_id: str, prompt: list[int], request: scheduler_pb2.GenerateRequest
    ) -> Generation:
        sampling = request.sampling
        info = self.info
        valid = validate_sampling(sampling, len(prompt), info)
        n, max_tokens = valid.n, valid.max_tokens
        generation = Generation(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            max_tokens=max_tokens,
            n=n,
            priority=request.priority,
            cache_salt=request.cache_salt,
            eos_token_ids=frozenset() if sampling.ignore_eos else frozenset(info.eos_token_ids),
            stop_token_ids=frozenset(sampling.stop_token_ids),
            beam=valid.beam,
            tokenizer=self.tokenizer,
        )
        block_size = info.block_size
        kv = next(iter(self.schedulers.values())).kv  # every executor serves one model
        for index in range(n):
            seq_request = kv.make_request(
                f"{request_id}/{index}" if n > 1 else request_id,
                prompt,
                cache_salt=request.cache_salt or None,
                max_tokens=max_tokens,
                priority=request.priority,
            )
            detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
            generation.sequences.append(
                Sequence(generation, index, seq_request, detokenizer=detokenizer)
            )
        needed = -(-(len(prompt) + 1) // block_size) + n
        if all(needed > s.info.num_blocks - 1 for s in self.schedulers.values()):
            raise ResourceExhausted(
                f"prompt: {len(prompt)} tokens need {needed} blocks; executors have at most "
                f"{max(s.info.num_blocks - 1 for s in self.schedulers.values())}"
            )
        return generation

    def _place(self, generation: Generation) -> str:
        """The executor for a new generation: longest cached prefix, then most
        free blocks."""
        request = generation.sequences[0].request

        def score(address: str) -> tuple[int, int]:
            kv = self.schedulers[address].kv
            hit = kv.get_computed_blocks(request, count=False).num_tokens
            return hit, kv.pool.get_num_free_blocks()

        return max(self.schedulers, key=score)

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
            if scheduler is not None:
                scheduler.release(seq)
                self._wake[scheduler.address].set()
        generation.flush()
        self._count_finished(generation)
        return True

    # -- the step loops -------------------------------------------------------

    async def _loop(self, address: str) -> None:
        try:
            await self._step_loop(address)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not hang its requests
            log.exception("step loop failed", executor=address)
            if address in self.schedulers:
                self._executor_down(address, f"scheduler error: {exc!r}")

    async def _step_loop(self, address: str) -> None:
        """Async stepping: step N + 1 is built and sent while the executor
        runs step N, so scheduling overlaps the executor's work; at most
        ``config.pipeline_depth`` steps are in flight."""
        scheduler = self.schedulers[address]
        client = self.clients[address]
        wake = self._wake[address]
        clock = time.perf_counter
        inflight: deque[tuple[ScheduledStep, float, float]] = deque()
        depth = self.config.pipeline_depth
        while True:
            step = None
            if len(inflight) < depth:
                t0 = clock()
                step = scheduler.schedule()
                if step is not None:
                    t1 = clock()
                    try:
                        await client.send(step.request)
                    except ExecutorDown as exc:
                        self._executor_down(address, str(exc))
                        return
                    inflight.append((step, t0, t1))
                    if len(inflight) < depth:
                        continue
            if not inflight:
                wake.clear()
                await wake.wait()
                continue
            sent, t0, t1 = inflight.popleft()
            try:
                response = await client.receive()
            except ExecutorDown as exc:
                self._executor_down(address, str(exc))
                return
            t2 = clock()
            touched = scheduler.process(sent, response)
            self._publish(touched, scheduler, t2 - t0)
            self.step_timings.append(
                StepTiming(
                    address,
                    len(sent.entries),
                    sum(e.num_scheduled for e in sent.entries),
                    t1 - t0,
                    t2 - t1,
                    response.host_time_us * 1e-6,
                    clock() - t2,
                )
            )
            await asyncio.sleep(0)  # let Generate handlers run between steps

    def _publish(
        self, touched: set[Generation], scheduler: ExecutorScheduler, seconds: float
    ) -> None:
        now = time.monotonic()
        metrics = self.metrics
        for generation in touched:
            if metrics is not None:
                if generation.first_token_at is None:
                    metrics.observe_first_token(now - generation.arrival)
                elif generation.last_token_at is not None:
                    metrics.observe_inter_token(now - generation.last_token_at)
            if generation.first_token_at is None:
                generation.first_token_at = now
            generation.last_token_at = now
            generation.flush()
            if generation.done and self.generations.get(generation.request_id) is generation:
                del self.generations[generation.request_id]
                self._count_finished(generation)
        if metrics is not None:
            kv = scheduler.kv
            stats = kv.prefix_cache_stats
            address = scheduler.address
            metrics.observe_step(address, seconds)
            metrics.set_kv_usage(address, kv.usage)
            metrics.set_prefix_cache(address, stats.queries, stats.hits)
            metrics.set_preemptions(self.num_preemptions)
            metrics.set_queue_sizes(self.num_running, self.num_waiting)

    def _count_finished(self, generation: Generation) -> None:
        reasons = sorted(
            {
                FinishReason.Name(s.finish_reason).removeprefix("FINISH_REASON_").lower()
                for s in generation.sequences
            }
        )
        log.info(
            "request finished",
            request_id=generation.request_id,
            finish_reasons=reasons,
            completion_tokens=sum(s.request.num_output_tokens for s in generation.sequences),
            cached_prompt_tokens=generation.num_cached_prompt_tokens,
            seconds=round(time.monotonic() - generation.arrival, 4),
        )
        if self.metrics is None:
            return
        for seq in generation.sequences:
            name = FinishReason.Name(seq.finish_reason).removeprefix("FINISH_REASON_").lower()
            self.metrics.count_finished(name)
        self.metrics.count_tokens(
            prompt=0, generated=sum(s.request.num_output_tokens for s in generation.sequences)
        )

    def _executor_down(self, address: str, why: str) -> None:
        """Marks an executor down and recomputes its sequences elsewhere."""
        log.warning("executor down", executor=address, error=why)
        self.down[address] = why
        scheduler = self.schedulers.pop(address)
        self._preemptions_of_down += scheduler.num_preemptions
        moved = scheduler.evacuate()
        targets: dict[Generation, str] = {}  # a generation's sequences stay together
        for seq in moved:
            generation = seq.generation
            if seq.finished:
                continue
            if not self.schedulers:
                seq.finish(FinishReason.FINISH_REASON_ERROR)
                generation.flush()
                if self.generations.pop(generation.request_id, None) is not None:
                    generation.chunks.put_nowait(Unavailable(f"every executor is down ({why})"))
                continue
            if generation not in targets:
                targets[generation] = max(
                    self.schedulers,
                    key=lambda a: self.schedulers[a].kv.pool.get_num_free_blocks(),
                )
            target = targets[generation]
            self.schedulers[target].add(seq)
            self._wake[target].set()

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
        for address, client in self.clients.items():
            scheduler = self.schedulers.get(address)
            executor = response.executors.add(address=address, healthy=scheduler is not None)
            if scheduler is None:
                continue
            kv = scheduler.kv
            prefix = kv.prefix_cache_stats
            executor.num_blocks = scheduler.info.num_blocks
            executor.num_free_blocks = kv.pool.get_num_free_blocks()
            executor.kv_cache_usage = kv.usage
            executor.prefix_cache_queries = prefix.queries
            executor.prefix_cache_hits = prefix.hits
            executor.incarnation_id = scheduler.info.incarnation_id
            executor.epoch = client.owner.epoch
            report = kv.check_integrity()
            if not report.ok:
                problems.append(f"{address}: " + "; ".join(report.errors))
        response.integrity.ok = not problems
        response.integrity.message = "\n".join(problems)
        return response
