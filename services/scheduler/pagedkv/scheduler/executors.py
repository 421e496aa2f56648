"""The executors' registry: which executors are in service, which are down
and why, their connections and scheduling state, and every path that
changes that: adoption, resync after the scheduler's own error (taken over
again, cold), marking an executor down by cause (``transport``,
``timeout``, ``fenced``: its sequences recomputed elsewhere, UNAVAILABLE
when none is left), moving its sequences, forgetting it (docs/scheduler.md,
"Failures"). Draining one and probing a down one until it is taken back:
``drain_and_probe.py``.

``Executors`` reaches the service that owns it only through
``ExecutorsHost``; the cluster member reaches it through ``ClusterHost``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from pagedkv.common.errors import ServiceError, Unavailable
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.cluster import ClusterMember
from pagedkv.scheduler.config import ClusterConfig, SchedulerConfig
from pagedkv.scheduler.drain_and_probe import drain, probe
from pagedkv.scheduler.executor_client import ExecutorClient, ExecutorDown
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.internal_errors import InternalErrors
from pagedkv.scheduler.metrics import SchedulerMetrics
from pagedkv.scheduler.sequence import Generation, Sequence
from pagedkv.scheduler.takeover import TakenOver, owned_by, take_over
from pagedkv.v1 import executor_pb2

log = get_logger(__name__)

MAX_UNATTRIBUTED_ERRORS = 3  # in a row on one executor: its generations fail
EXECUTOR_DRAIN_MARGIN_S = 1.0  # a stopping executor's time kept to move what still runs


class ExecutorsHost(Protocol):
    """What the registry needs of the service that owns it: whether it is
    stopping, how a generation ends when no executor can run it, the
    executors' step loops, its background tasks, and the model's tokenizer."""

    @property
    def draining(self) -> bool: ...
    def fail(self, generation: Generation, error: ServiceError) -> None: ...
    def hand_back(self, generation: Generation, error: Unavailable) -> None: ...
    def start_loop(self, address: str) -> None: ...
    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None: ...
    def model_known(self, info: executor_pb2.GetInfoResponse) -> None: ...


class Executors:
    """The executors in service and out of it. Only its methods change its
    dicts and sets; an executor's own queues change through its
    ``ExecutorScheduler``. It serves the cluster member as its ``ClusterHost``."""

    def __init__(
        self,
        config: SchedulerConfig,
        scheduler_id: str,
        host: ExecutorsHost,
        errors: InternalErrors,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.config = config
        self.scheduler_id = scheduler_id  # the owner id executors are taken over as
        self.host = host
        self.errors = errors
        self.metrics = metrics
        self.info = executor_pb2.GetInfoResponse()  # the model every executor serves
        self.clients: dict[str, ExecutorClient] = {}
        self.schedulers: dict[str, ExecutorScheduler] = {}  # executors in service
        self.down: dict[str, str] = {}  # address -> why ("cause: detail")
        self.recoveries: dict[str, int] = {}  # address -> times taken back
        self.wake: dict[str, asyncio.Event] = {}  # set: its step loop looks again (and clears it)
        self.cluster: ClusterMember | None = None  # the Redis control plane, if any
        self._resync: set[str] = set()  # executors whose accounting must be rebuilt
        self._unattributed: dict[str, int] = {}  # errors in a row with no culprit
        self._preemptions_of_down = 0  # preemptions on executors dropped since

    @property
    def draining(self) -> bool:
        """The scheduler is stopping (``ClusterHost``)."""
        return self.host.draining

    def internal_error(self, exc: BaseException, where: str) -> ServiceError:
        return self.errors.report(exc, where)

    @property
    def num_running(self) -> int:
        return sum(len(s.running) for s in self.schedulers.values())

    @property
    def num_waiting(self) -> int:
        return sum(len(s.waiting) for s in self.schedulers.values())

    @property
    def num_preemptions(self) -> int:
        return self._preemptions_of_down + sum(s.num_preemptions for s in self.schedulers.values())

    # -- taking executors over --------------------------------------------------

    def join(self, config: ClusterConfig) -> ClusterMember:
        """Makes this scheduler a cluster member (started by the caller):
        executors then come from its claims."""
        self.cluster = ClusterMember(self, config)
        return self.cluster

    def new_client(self, address: str) -> ExecutorClient:
        return ExecutorClient(
            address,
            self.scheduler_id,
            timeout=self.config.executor_timeout,
            tls=self.config.executor_tls,
        )

    async def take_over_all(self) -> None:
        """Without a cluster: takes over every configured executor that
        answers and starts its step loop; the others are marked down and
        probed. Raises Unavailable if none answers, ValueError if one serves
        another model."""
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
        self.host.model_known(self.info)
        for address in self.schedulers:
            self.host.start_loop(address)
        for address in self.down:
            self.host.spawn(probe(self, address))

    async def take_over(
        self,
        client: ExecutorClient,
        info: executor_pb2.GetInfoResponse | None = None,
        *,
        cold: bool = False,
    ) -> TakenOver:
        """``takeover.take_over``, in a cluster with the epoch of the
        executor's lease. Changes nothing here; raises ExecutorDown."""
        epoch = None
        if self.cluster is not None:
            if info is None:
                info = await client.get_info()
            epoch = await self.cluster.epoch_for(client.address, info)
        return await take_over(client, info, epoch=epoch, cold=cold)

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
            host_cached=taken.host_cached,
            decode_window=self.config.decode_window,
            host_loads=self.config.host_loads,
            host_offload=self.config.host_offload,
            host_idle_offload_blocks=self.config.host_idle_offload_blocks,
        )
        self.schedulers[address] = scheduler
        if self.metrics is not None:  # fixed for the incarnation: set once, not per step
            self.metrics.set_kv_blocks(
                address, scheduler.kv_cache_dtype, info.num_blocks, info.bytes_per_block
            )
        if self.cluster is not None:
            self.cluster.adopted(scheduler)
        self.down.pop(address, None)
        self.wake.setdefault(address, asyncio.Event()).set()
        log.info(
            "executor taken over",
            executor=address,
            epoch=client.owner.epoch,
            num_blocks=info.num_blocks,
            cached_blocks=scheduler.num_adopted_cached_blocks,
            incarnation=info.incarnation_id,
        )
        return scheduler

    def adopt_claimed(self, address: str, client: ExecutorClient, taken: TakenOver) -> None:
        """Puts an executor the cluster member just claimed in service and
        starts its step loop (the first one also tells the service the model)."""
        if not self.info.model_id:
            self.info = taken.info
            self.host.model_known(taken.info)
        self._adopt(address, client, taken)
        self.host.start_loop(address)

    # -- sequences on an executor -----------------------------------------------

    def queue(self, address: str, seq: Sequence) -> None:
        """Queues a sequence on an executor in service and wakes its loop."""
        self.schedulers[address].add(seq)
        self.wake[address].set()

    def release(self, seq: Sequence, where: str, request_id: str) -> None:
        """Frees a finished sequence's rows and blocks on its executor (if in
        service) and wakes its loop. A release that raises leaves the
        executor to be resynced (its accounting is in doubt)."""
        scheduler = self.schedulers.get(seq.executor or "")
        if scheduler is None:
            return
        try:
            scheduler.release(seq)
        except Exception as exc:
            self.errors.report(exc, where, request_id=request_id)
            self._resync.add(scheduler.address)
        self.wake[scheduler.address].set()

    # -- the scheduler's own errors ---------------------------------------------

    def must_resync(self, address: str) -> bool:
        """Whether the executor's accounting is in doubt (its loop resyncs)."""
        return address in self._resync

    def step_succeeded(self, address: str) -> None:
        """A step applied without error: the unattributed errors in a row restart."""
        self._unattributed.pop(address, None)

    def unattributed_error(self, scheduler: ExecutorScheduler) -> None:
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
            self.host.fail(generation, error)

    async def resync(self, address: str) -> bool:
        """Takes the executor over again (a higher epoch frees its rows and
        fences steps in flight), cold (its tags dropped: the accounting that
        set them is in doubt), and queues its unfinished sequences there to
        be recomputed. Returns False when it could not be taken over (it is
        then marked down)."""
        self._resync.discard(address)
        client = self.clients[address]
        try:
            info = await client.get_info()
            if not client.owned_by_us(info):  # never take it from another owner
                self.executor_down(address, f"fenced: {owned_by(info)}", "fenced")
                return False
            taken = await self.take_over(client, info, cold=True)
        except ExecutorDown as exc:
            self.executor_down(address, str(exc), exc.cause)
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

    # -- out of service -----------------------------------------------------------

    def lose_executor(self, address: str, why: str) -> None:
        """Its lease was lost: the executor leaves service here at once (its
        sequences are recomputed elsewhere) and is forgotten."""
        if address in self.schedulers:
            self.executor_down(address, f"fenced: {why}", "fenced")
        elif address in self.clients:
            self.host.spawn(self.forget(address))

    def executor_down(self, address: str, why: str, cause: str) -> None:
        """Marks an executor in service down (``cause``: transport, timeout,
        fenced), recomputes its sequences elsewhere (or ends them with
        FINISH_REASON_ERROR and UNAVAILABLE when none is left) and starts
        probing it. In a cluster, an executor another owner took over is
        forgotten instead (its lease is theirs)."""
        if address not in self.schedulers:
            return  # given up meanwhile
        log.warning("executor down", executor=address, cause=cause, error=why)
        self.down[address] = why
        if self.metrics is not None:
            self.metrics.count_executor_down(address, cause)
        scheduler = self.schedulers.pop(address)
        self.wake[address].set()  # an idle step loop ends
        self._resync.discard(address)
        self._preemptions_of_down += scheduler.num_preemptions
        self.move_elsewhere(scheduler.evacuate(), f"every executor is down ({why})")
        if cause == "fenced" and self.cluster is not None:
            self.cluster.lost(address)
            self.host.spawn(self.forget(address))
            return
        self.host.spawn(probe(self, address))

    def move_elsewhere(self, moved: list[Sequence], why: str) -> None:
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
                    self.host.hand_back(generation, Unavailable(why))
                else:
                    self.host.fail(generation, Unavailable(why))
                continue
            if generation not in targets:
                targets[generation] = max(
                    open_, key=lambda a: self.schedulers[a].kv.pool.get_num_free_blocks()
                )
            self.queue(targets[generation], seq)

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

    async def close(self) -> None:
        """Closes every executor's connection (the service is stopping)."""
        for client in self.clients.values():
            await client.close()

    # -- giving an executor up and taking it back ------------------------------

    async def drain_executor(self, address: str, timeout: float, why: str) -> None:
        """Gives an executor up gracefully (``drain_and_probe.drain``); the
        caller releases the lease and calls ``forget``."""
        await drain(self, address, timeout, why)

    def remove_drained(self, scheduler: ExecutorScheduler, why: str) -> None:
        """A drained executor leaves service: what is still there moves to
        the others (UNAVAILABLE ``why`` when none is left), its loop ends."""
        address = scheduler.address
        del self.schedulers[address]
        self._preemptions_of_down += scheduler.num_preemptions
        self.move_elsewhere(scheduler.evacuate(), why)
        scheduler.give_up()
        self.wake[address].set()

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
            self.host.spawn(self.cluster.give_up(address, timeout, why))
        else:
            self.host.spawn(self._drain_then_probe(address, timeout, why))

    async def _drain_then_probe(self, address: str, timeout: float, why: str) -> None:
        await drain(self, address, timeout, why)
        if address in self.schedulers or address in self.down or address not in self.clients:
            return  # taken back or down meanwhile
        self.down[address] = why
        self.host.spawn(probe(self, address))

    def still_down(self, address: str, why: str) -> None:
        """A probe found the down executor not adoptable yet (``why``)."""
        self.down[address] = self.down[address].split(";")[0] + f"; now: {why}"

    def taken_back(self, address: str, client: ExecutorClient, taken: TakenOver) -> None:
        """A probed executor was taken over: in service again, its loop started."""
        self.recoveries[address] = self.recoveries.get(address, 0) + 1
        if self.metrics is not None:
            self.metrics.count_recovery(address)
        self._adopt(address, client, taken)
        self.host.start_loop(address)
