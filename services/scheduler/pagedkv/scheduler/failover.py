"""How the scheduler meets failure: generations that end in error, executors
lost and taken back (see the "Failures" section of docs/scheduler.md).

``ExecutorFailover`` holds the executors' connections and scheduling state
and every path that changes which executors are in service: adoption,
resync after the scheduler's own error, marking down by cause, and probing a
down executor until it can be taken back. ``SchedulerService`` builds on it
with requests and step loops.

Failures are told apart by cause (docs/scheduler.md, "Failures"):

* an error in the scheduler's own code ends the generation it concerns with
  FINISH_REASON_ERROR and INTERNAL; when the executor's accounting can no
  longer be trusted (the step was half built, the pool check fails, the
  executor refused a step) the executor is *resynced*: taken over again with
  a higher epoch and a cold cache, its other sequences recomputed there;
* a broken connection (``transport``), a step past the executor timeout
  (``timeout``) or another owner's takeover (``fenced``) marks the executor
  down: its sequences are recomputed elsewhere, or end with
  FINISH_REASON_ERROR and UNAVAILABLE when no executor is left, and the
  executor is probed with backoff until it can be taken back.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from pagedkv.common.errors import ServiceError, Unavailable
from pagedkv.common.ids import MAX_EPOCH
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.executor_client import PROBE_TIMEOUT_S, ExecutorClient, ExecutorDown
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.metrics import SchedulerMetrics
from pagedkv.scheduler.sequence import FinishReason, Generation, Sequence
from pagedkv.scheduler.takeover import TakenOver
from pagedkv.v1 import executor_pb2

if TYPE_CHECKING:
    from pagedkv.scheduler.cluster import ClusterMember

log = get_logger(__name__)

PROBE_BACKOFF_S = (0.25, 5.0)  # first and longest wait between probes of a down executor
MAX_UNATTRIBUTED_ERRORS = 3  # in a row on one executor: its generations fail
EXECUTOR_DRAIN_MARGIN_S = 1.0  # a stopping executor's time kept to move what still runs


def _owner(info: executor_pb2.GetInfoResponse) -> str:
    return f"owned by {info.owner.owner_id!r} at epoch {info.owner.epoch}"


class Resync(Exception):
    """The executor's accounting must be rebuilt (raised inside its loop)."""


class ExecutorFailover:
    """The executors in service and out of it, and how generations fail."""

    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics | None) -> None:
        self.config = config
        self.scheduler_id = config.scheduler_id or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.metrics = metrics
        self.info = executor_pb2.GetInfoResponse()  # the model every executor serves
        self.clients: dict[str, ExecutorClient] = {}
        self.schedulers: dict[str, ExecutorScheduler] = {}  # executors in service
        self.down: dict[str, str] = {}  # address -> why ("cause: detail")
        self.recoveries: dict[str, int] = {}  # address -> times taken back
        self.generations: dict[str, Generation] = {}
        self.num_internal_errors = 0
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._resync: set[str] = set()  # executors whose accounting must be rebuilt
        self._unattributed: dict[str, int] = {}  # errors in a row with no culprit
        self._preemptions_of_down = 0  # preemptions on executors dropped since
        self.cluster: ClusterMember | None = None  # the Redis control plane, if any

    async def _loop(self, address: str) -> None:
        """The executor's step loop (``SchedulerService``)."""
        raise NotImplementedError

    def new_client(self, address: str) -> ExecutorClient:
        return ExecutorClient(
            address,
            self.scheduler_id,
            timeout=self.config.executor_timeout,
            tls=self.config.executor_tls,
        )

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def take_over(
        self,
        client: ExecutorClient,
        info: executor_pb2.GetInfoResponse | None = None,
        *,
        epoch: int | None = None,
        cold: bool = False,
    ) -> TakenOver:
        """Takes the executor over (Reset: its rows are freed, its KV kept)
        and reads its tagged blocks, so the prefix cache survives the
        takeover; ``cold`` drops the tags instead (the scheduler's own
        accounting was in doubt). In a cluster the epoch comes from the
        executor's lease. Raises ExecutorDown."""
        if epoch is None and self.cluster is not None:
            if info is None:
                info = await client.get_info()
            epoch = await self.cluster.epoch_for(client.address, info)
        info = await client.connect(info, epoch=epoch, drop_cached_blocks=cold)
        cached = [] if cold else await client.list_cached_blocks()
        return TakenOver(info, cached)

    def _adopt(self, address: str, client: ExecutorClient, taken: TakenOver) -> ExecutorScheduler:
        """Puts an executor just taken over in service with fresh scheduling
        state (its prefix-cache index holds the executor's tagged blocks)
        and wakes its step loop; the caller starts that loop if none runs."""
        info = taken.info
        self.clients[address] = client
        scheduler = ExecutorScheduler(
            address,
            info,
            client.owner,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            cached=taken.cached,
            decode_window=self.config.decode_window,
        )
        self.schedulers[address] = scheduler
        if self.cluster is not None:
            self.cluster.adopted(scheduler)
        self.down.pop(address, None)
        self._wake.setdefault(address, asyncio.Event()).set()
        log.info(
            "executor taken over",
            executor=address,
            epoch=client.owner.epoch,
            num_blocks=info.num_blocks,
            cached_blocks=scheduler.num_adopted_cached_blocks,
            incarnation=info.incarnation_id,
        )
        return scheduler

    def _end(self, generation: Generation, error: ServiceError | None = None) -> None:
        """Queues a finished generation's last chunk (then ``error``, the
        status its stream ends with) and forgets it."""
        try:
            generation.flush()
        except Exception as exc:
            error = error or self.internal_error(exc, "flush", request_id=generation.request_id)
        if error is not None:
            generation.done = True
            generation.chunks.put_nowait(error)
        if self.generations.get(generation.request_id) is generation:
            del self.generations[generation.request_id]
        self._count_finished(generation)

    def _fail(self, generation: Generation, error: ServiceError) -> None:
        """Ends a generation with FINISH_REASON_ERROR (its blocks released)
        and its stream with ``error``. A release that raises leaves its
        executor to be resynced."""
        if generation.done:
            return
        self._finish_and_release(generation, str(error))
        self._end(generation, error)

    def _hand_back(self, generation: Generation, error: Unavailable) -> None:
        """Ends a generation that another replica can continue (this
        scheduler is stopping, or in a cluster its last executor went to
        another member) as a broken stream: its news so far in a chunk that
        is not final, its blocks released, then ``error`` (UNAVAILABLE), so
        the SDK resumes it elsewhere with the tokens received. A final chunk
        would tell the SDK the request ended here. n > 1 and beam searches
        cannot be resumed: they fail (``_fail``)."""
        if generation.done:
            return
        if generation.n > 1 or generation.beam is not None:
            self._fail(generation, error)
            return
        if all(seq.finished for seq in generation.sequences):
            self._end(generation)  # it has finished: its final chunk goes out
            return
        try:
            generation.flush()  # not final: its sequence has not finished
        except Exception as exc:
            self._fail(
                generation, self.internal_error(exc, "flush", request_id=generation.request_id)
            )
            return
        self._finish_and_release(generation, str(error))
        generation.done = True  # no final chunk after the news
        generation.chunks.put_nowait(error)
        if self.generations.get(generation.request_id) is generation:
            del self.generations[generation.request_id]
        self._count_finished(generation)

    def _finish_and_release(self, generation: Generation, why: str) -> None:
        """Finishes the generation's unfinished sequences with
        FINISH_REASON_ERROR and releases every sequence's blocks. A release
        that raises leaves its executor to be resynced."""
        for seq in generation.sequences:
            if not seq.finished:
                seq.finish(FinishReason.FINISH_REASON_ERROR, error_message=why)
        for seq in generation.sequences:
            scheduler = self.schedulers.get(seq.executor or "")
            if scheduler is None:
                continue
            try:
                scheduler.release(seq)
            except Exception as exc:
                self.internal_error(exc, "release", request_id=generation.request_id)
                self._resync.add(scheduler.address)
            self._wake[scheduler.address].set()

    def internal_error(self, exc: BaseException, where: str, **context: Any) -> ServiceError:
        """Logs and counts an error in the scheduler's own code; returns the
        INTERNAL error its requests end with (an id ties it to the log)."""
        error_id = uuid.uuid4().hex[:12]
        self.num_internal_errors += 1
        if self.metrics is not None:
            self.metrics.count_internal_error()
        log.error("internal error", where=where, error_id=error_id, exc_info=exc, **context)
        return ServiceError(f"internal error in the scheduler (error id {error_id})")

    def _unattributed_error(self, scheduler: ExecutorScheduler) -> None:
        """Counts an error with no known culprit on this executor; after
        MAX_UNATTRIBUTED_ERRORS in a row every generation there fails, so a
        bug that recurs on every recompute cannot loop forever."""
        address = scheduler.address
        count = self._unattributed.get(address, 0) + 1
        self._unattributed[address] = count
        if count < MAX_UNATTRIBUTED_ERRORS:
            return
        self._unattributed[address] = 0
        error = ServiceError(
            f"internal error in the scheduler: {count} in a row on executor {address}"
        )
        for generation in {seq.generation for seq in scheduler.sequences}:
            self._fail(generation, error)

    async def _owner_if_fenced(self, address: str) -> str | None:
        """The executor's owner when it is not us any more (None: it still
        is ours, or it does not answer)."""
        client = self.clients[address]
        try:
            info = await client.get_info(timeout=min(PROBE_TIMEOUT_S, client.timeout))
        except ExecutorDown:
            return None
        if client.owned_by_us(info):
            return None
        return _owner(info)

    async def _resync_executor(self, address: str) -> bool:
        """Takes the executor over again (a higher epoch frees its rows and
        fences steps in flight), cold (its tags dropped: the accounting that
        set them is in doubt), and queues its
        unfinished sequences there to be recomputed. Returns False when it
        could not be taken over (it is then marked down)."""
        self._resync.discard(address)
        client = self.clients[address]
        try:
            info = await client.get_info()
            if not client.owned_by_us(info):  # never take it from another owner
                self._executor_down(address, f"fenced: {_owner(info)}", "fenced")
                return False
            taken = await self.take_over(client, info, cold=True)
        except ExecutorDown as exc:
            self._executor_down(address, str(exc), exc.cause)
            return False
        old = self.schedulers[address]
        self._preemptions_of_down += old.num_preemptions
        moved = old.evacuate()
        scheduler = self._adopt(address, client, taken)
        for seq in moved:
            if not seq.finished:
                scheduler.add(seq)
        log.warning("executor resynced", executor=address, requeued=len(moved))
        return True

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

    def _executor_down(self, address: str, why: str, cause: str) -> None:
        """Marks an executor down, recomputes its sequences elsewhere (or ends
        them with FINISH_REASON_ERROR and UNAVAILABLE when none is left) and
        starts probing it. In a cluster, an executor another owner took over
        is forgotten instead (its lease is theirs)."""
        if address not in self.schedulers:
            return  # given up meanwhile
        log.warning("executor down", executor=address, cause=cause, error=why)
        self.down[address] = why
        if self.metrics is not None:
            self.metrics.count_executor_down(address, cause)
        scheduler = self.schedulers.pop(address)
        self._wake[address].set()  # an idle step loop ends
        self._resync.discard(address)
        self._preemptions_of_down += scheduler.num_preemptions
        self._move_elsewhere(scheduler.evacuate(), f"every executor is down ({why})")
        if cause == "fenced" and self.cluster is not None:
            self.cluster.lost(address)
            self._spawn(self.forget(address))
            return
        self._spawn(self._recover(address))

    def _move_elsewhere(self, moved: list[Sequence], why: str) -> None:
        """Queues sequences taken off an executor on the others (the fullest
        free pool first, a generation's sequences together, draining
        executors last); with none left they end with UNAVAILABLE ``why``:
        handed back to the SDK in a cluster (another member serves), failed
        otherwise (docs/scheduler.md, "Failures")."""
        targets: dict[Generation, str] = {}
        open_ = [a for a, s in self.schedulers.items() if not s.draining] or list(self.schedulers)
        for seq in moved:
            generation = seq.generation
            if seq.finished or generation.done:
                continue
            if not open_:
                if self.cluster is not None:
                    self._hand_back(generation, Unavailable(why))
                else:
                    self._fail(generation, Unavailable(why))
                continue
            if generation not in targets:
                targets[generation] = max(
                    open_, key=lambda a: self.schedulers[a].kv.pool.get_num_free_blocks()
                )
            target = targets[generation]
            self.schedulers[target].add(seq)
            self._wake[target].set()

    async def forget(self, address: str) -> None:
        """Drops every trace of an executor that is no longer ours (its lease
        was lost or given up): its connection, and its probing stops."""
        if self.cluster is not None:
            self.cluster.lost(address)
        self.down.pop(address, None)
        self.recoveries.pop(address, None)
        client = self.clients.pop(address, None)
        if client is not None:
            await client.close()

    async def drain_executor(self, address: str, timeout: float, why: str) -> None:
        """Gives an executor up gracefully: nothing new is admitted there,
        sequences not started there move to the other executors at once,
        running ones get ``timeout`` seconds to finish, then the rest move
        too (recomputed; UNAVAILABLE ``why`` when no executor is left). Returns
        once its step loop has stopped with no step in flight; the caller
        releases the lease and calls ``forget``."""
        scheduler = self.schedulers.get(address)
        if scheduler is None:
            return
        scheduler.start_draining()
        log.info("executor draining", executor=address, running=len(scheduler.running))
        deadline = time.monotonic() + timeout
        while self.schedulers.get(address) is scheduler:
            idle = scheduler.take_unstarted()
            if idle and len(self.schedulers) > 1:
                self._move_elsewhere(idle, why)
            else:
                for seq in idle:
                    scheduler.add(seq)
            if not scheduler.running or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if self.schedulers.get(address) is not scheduler:
            return  # it went down meanwhile
        del self.schedulers[address]
        self._preemptions_of_down += scheduler.num_preemptions
        self._move_elsewhere(scheduler.evacuate(), why)
        scheduler.give_up()
        self._wake[address].set()
        await scheduler.stopped.wait()
        log.info("executor given up", executor=address)

    def executor_draining(self, address: str, seconds_left: float) -> None:
        """The executor said it is stopping (SIGTERM; a step's response
        carries ``draining``). It is drained like one given up, within the
        time it has left less ``EXECUTOR_DRAIN_MARGIN_S`` (to move what is
        still running before it stops), then given up: in a cluster its
        lease is released (its next incarnation registers anew); on its own
        it is marked down and probed until a new incarnation answers."""
        scheduler = self.schedulers.get(address)
        if scheduler is None or scheduler.draining:
            return  # already being given up
        scheduler.start_draining()
        why = f"executor {address} is stopping"
        timeout = max(0.0, seconds_left - EXECUTOR_DRAIN_MARGIN_S)
        log.info("executor stopping", executor=address, seconds_left=round(seconds_left, 1))
        if self.cluster is not None:
            self._spawn(self.cluster.give_up(address, timeout, why))
        else:
            self._spawn(self._drain_then_probe(address, timeout, why))

    async def _drain_then_probe(self, address: str, timeout: float, why: str) -> None:
        await self.drain_executor(address, timeout, why)
        if address in self.schedulers or address in self.down or address not in self.clients:
            return  # taken back or down meanwhile
        self.down[address] = why
        self._spawn(self._recover(address))

    async def _recover(self, address: str) -> None:
        """Probes a down executor with backoff (GetInfo on a fresh channel)
        and takes it back when it answers: a new incarnation as a fresh
        executor, the same one (it hung, or lost its connection) re-adopted
        with a higher epoch and the cache its block tags vouch for (a step in
        flight when it went down either ran before the Reset or never will).
        An executor another owner has taken over is left to that owner."""
        await self.clients[address].close()
        delay, longest = PROBE_BACKOFF_S
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, longest)
            if address not in self.down:
                return  # forgotten
            client = self.new_client(address)
            try:
                info = await client.get_info(timeout=min(PROBE_TIMEOUT_S, client.timeout))
                why = self._not_adoptable(address, info)
                if why is None:
                    taken = await self.take_over(client, info)
            except ExecutorDown as exc:
                why = str(exc)
            if why is not None:
                self.down[address] = self.down[address].split(";")[0] + f"; now: {why}"
                await client.close()
                continue
            self.recoveries[address] = self.recoveries.get(address, 0) + 1
            if self.metrics is not None:
                self.metrics.count_recovery(address)
            self._adopt(address, client, taken)
            self._spawn(self._loop(address))
            return

    def _not_adoptable(self, address: str, info: executor_pb2.GetInfoResponse) -> str | None:
        """Why a probed executor cannot be taken back (None: it can)."""
        if info.model_id != self.info.model_id:
            return f"it serves {info.model_id!r}, not {self.info.model_id!r}"
        owner = info.owner.owner_id
        if owner and owner != self.scheduler_id:
            return _owner(info)
        if info.owner.epoch >= MAX_EPOCH:
            return f"its epoch {info.owner.epoch} is the maximum; restart it"
        if info.draining:
            return "it is stopping"
        return None
