"""The scheduler service: generations in, steps out to every executor, chunks
back to the Generate streams. One asyncio loop; text prompts are encoded on
worker threads (``pagedkv.common.text_prompts``) so that no prompt can stall it.

``SchedulerService`` is composed of owned parts, each the one writer of its
state: ``Executors`` (executors.py: the executors in service and down, and
every path that changes that), ``Generations`` (generations.py: the live
generations and how they end), ``StepLoops`` (step_loop.py: one step loop
per executor) and ``InternalErrors`` (its own errors, counted). It keeps
admission (a generation is placed on one executor when it arrives: the
longest cached prefix, then the most free blocks), its life (start, drain,
stop), its background tasks and the stats.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pagedkv.common.errors import (
    AlreadyExists,
    InvalidArgument,
    ServiceError,
    Unavailable,
)
from pagedkv.common.ids import MAX_REQUEST_ID_BYTES
from pagedkv.common.logging import get_logger
from pagedkv.common.loop_lag import LoopLag
from pagedkv.common.tasks import cancel_and_wait
from pagedkv.common.text import TextTokenizer
from pagedkv.common.text_prompts import PromptEncoder
from pagedkv.scheduler.audits import Audits
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.executors import Executors
from pagedkv.scheduler.generations import Generations
from pagedkv.scheduler.internal_errors import InternalErrors
from pagedkv.scheduler.metrics import SchedulerMetrics
from pagedkv.scheduler.placement import new_generation, place
from pagedkv.scheduler.sequence import Generation
from pagedkv.scheduler.step_loop import StepLoops
from pagedkv.scheduler.validation import prompt_token_ids
from pagedkv.v1 import executor_pb2, scheduler_pb2

__all__ = ["SchedulerConfig", "SchedulerService"]

log = get_logger(__name__)


class SchedulerService:
    """Owns the executors' registry, the generations, their step loops and
    its background tasks; serves the registry as its ``ExecutorsHost``."""

    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.scheduler_id = config.scheduler_id or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.errors = InternalErrors(metrics)
        self.audits = Audits()  # GetStats' integrity audits, bounded under load
        self.executors = Executors(config, self.scheduler_id, self, self.errors, metrics)
        self.generations = Generations(self.executors, self.errors, metrics)
        self.loops = StepLoops(config, self.executors, self.generations, self.errors, metrics)
        self.tokenizer: TextTokenizer | None = None
        self.prompts = PromptEncoder()  # text prompts, encoded off the loop
        self.loop_lag = LoopLag(metrics.observe_loop_lag) if metrics is not None else None
        self._keys = itertools.count(1)  # generations' serial numbers
        self._tasks: set[asyncio.Task[None]] = set()  # step loops, probes, drains
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
            cluster = self.executors.join(self.config.cluster)
            if self.metrics is not None:
                self.metrics.watch_cluster(cluster)
            await cluster.start()
            return
        await self.executors.take_over_all()

    # -- what the executors' registry asks of the service (ExecutorsHost) ------

    def model_known(self, info: executor_pb2.GetInfoResponse) -> None:
        """The executors' model is known (the first one taken over): its tokenizer is loaded."""
        self.tokenizer = TextTokenizer.from_model_dir(self.config.model_dir or info.model_id)

    def start_loop(self, address: str) -> None:
        """Starts the step loop of an executor just put in service."""
        self.spawn(self.loops.run(address))

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Runs ``coroutine`` as a background task; ``stop`` cancels it."""
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def fail(self, generation: Generation, error: ServiceError) -> None:
        """``Generations.fail``: no executor can run the generation."""
        self.generations.fail(generation, error)

    def hand_back(self, generation: Generation, error: Unavailable) -> None:
        """``Generations.hand_back``: another cluster member can resume it."""
        self.generations.hand_back(generation, error)

    # -- stopping ---------------------------------------------------------------

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
        executors = self.executors
        log.info("scheduler draining", running=executors.num_running, waiting=executors.num_waiting)
        why = "the scheduler is stopping; resume on another replica"
        for scheduler in list(executors.schedulers.values()):
            scheduler.start_draining()
            for seq in list(scheduler.waiting):
                if seq.row is None and not seq.generation.done:
                    self.generations.hand_back(seq.generation, Unavailable(why))
        if executors.cluster is not None:
            await executors.cluster.leave(drain_timeout)
        else:
            deadline = time.monotonic() + drain_timeout
            while executors.num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        for generation in list(self.generations.live.values()):
            self.generations.hand_back(generation, Unavailable(why))
        await self.stop()

    async def stop(self) -> None:
        """Ends every live generation (ABORT), cancels the background tasks
        and closes the executors."""
        for generation in list(self.generations.live.values()):
            self.abort(generation.request_id)
        await cancel_and_wait(self._tasks)  # a cancellation can be lost (tasks.py)
        await self.executors.close()
        self.prompts.close()
        if self.loop_lag is not None:
            await self.loop_lag.stop()
        cluster = self.executors.cluster
        if cluster is not None and not cluster.leaving:
            await cluster.close()

    # -- requests -------------------------------------------------------------

    async def encode_text(self, request: scheduler_pb2.GenerateRequest) -> list[int] | None:
        """The token ids of a text prompt, encoded off the event loop (text
        too long to fit the model is refused before: ``pagedkv.common.text_prompts``);
        None for token ids, or when the model has no tokenizer (``submit``
        refuses that). Raises the service errors ``submit`` would raise first."""
        if request.WhichOneof("prompt") != "text" or self.tokenizer is None:
            return None
        self._check_open()
        max_model_len = self.executors.info.max_model_len
        try:
            return await self.prompts.encode(request.text, self.tokenizer, max_model_len)
        except ServiceError:
            raise
        except Exception as exc:
            raise self.errors.report(exc, "encode", request_id=request.request_id) from exc

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
            raise self.errors.report(exc, "submit", request_id=request.request_id) from exc

    def _check_open(self) -> None:
        """Unavailable while draining or with no executor in service."""
        if self.draining:
            raise Unavailable("the scheduler is stopping; send the request to another replica")
        if not self.executors.schedulers:
            raise Unavailable(
                "no executor is available: " + "; ".join(self.executors.down.values())
            )

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
        info, schedulers = self.executors.info, self.executors.schedulers
        prompt = prompt_token_ids(request, text_ids, info.vocab_size)
        tokenizer = None if request.skip_text else self.tokenizer  # skip_text: no text made
        generation = new_generation(
            request_id, prompt, request, info, tokenizer, schedulers, next(self._keys)
        )
        executor, hint = place(schedulers, generation, request.preferred_executor)
        generation.placement = scheduler_pb2.Placement(executor=executor, hint=hint)
        if self.metrics is not None:
            self.metrics.count_placement_hint(hint)
        self.generations.add(generation)
        self.executors.queue(executor, generation.sequences[0])
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
        return self.generations.abort(request_id)

    # -- stats ----------------------------------------------------------------

    def stats(self, reset_peak_used_blocks: bool = False) -> scheduler_pb2.GetStatsResponse:
        """The replica's snapshot; with ``reset_peak_used_blocks``, each
        pool's peak starts over once read."""
        executors = self.executors
        response = scheduler_pb2.GetStatsResponse(
            num_running=executors.num_running,
            num_waiting=executors.num_waiting,
            num_preemptions=executors.num_preemptions,
            scheduler_id=self.scheduler_id,
        )
        problems = []
        response.num_internal_errors = self.errors.count
        for address, client in executors.clients.items():
            scheduler = executors.schedulers.get(address)
            executor = response.executors.add(
                address=address,
                healthy=scheduler is not None,
                down_reason=executors.down.get(address, ""),
                num_recoveries=executors.recoveries.get(address, 0),
            )
            if scheduler is None:
                continue
            kv = scheduler.kv
            prefix = kv.prefix_cache_stats
            executor.suspect = client.suspect
            executor.num_blocks = scheduler.info.num_blocks
            executor.num_usable_blocks = scheduler.info.num_blocks - 1
            executor.num_free_blocks = kv.pool.get_num_free_blocks()
            executor.peak_used_blocks = kv.pool.peak_used_blocks
            if reset_peak_used_blocks:
                kv.pool.reset_peak()
            executor.kv_cache_usage = kv.usage
            executor.prefix_cache_queries = prefix.queries
            executor.prefix_cache_hits = prefix.hits
            if kv.host is not None:
                host = kv.host.stats
                executor.num_host_blocks = host.num_blocks
                executor.num_cached_host_blocks = host.num_cached
                executor.prefix_cache_host_hits = prefix.host_hits
                executor.num_offloaded_blocks = host.num_offloaded
                executor.num_loaded_blocks = host.num_loaded
                executor.host_loads_chosen = host.num_loads_chosen
                executor.host_recomputes_chosen = host.num_recomputes_chosen
                costs = kv.host.costs
                executor.prefill_seconds_per_token = costs.prefill_seconds_per_token
                executor.host_load_seconds = costs.load_seconds
                executor.host_load_seconds_per_block = costs.load_seconds_per_block
                per_block = scheduler.info.bytes_per_block
                executor.offloaded_bytes = host.num_offloaded * per_block
                executor.loaded_bytes = host.num_loaded * per_block
                executor.offload_copy_seconds = host.offload_seconds
                executor.load_copy_seconds = host.load_seconds
            executor.incarnation_id = scheduler.info.incarnation_id
            executor.kv_cache_dtype = scheduler.kv_cache_dtype
            executor.bytes_per_block = scheduler.info.bytes_per_block
            executor.epoch = client.owner.epoch
            executor.num_adopted_cached_blocks = scheduler.num_adopted_cached_blocks
            executor.draining = scheduler.draining
            report = self.audits.report(scheduler)
            if not report.ok:
                problems.append(f"{address}: " + "; ".join(report.errors))
        response.integrity.ok = not problems
        response.integrity.message = "\n".join(problems)
        response.draining = self.draining
        if executors.cluster is not None:
            response.cluster.CopyFrom(executors.cluster.view)
        return response
