"""An executor leaving service gracefully and one coming back: ``drain``
gives an executor up without losing what runs there, ``probe`` asks a down
one with backoff until it can be taken back. Both are long-running paths of
the executors' registry (``executors.py``), which spawns them; they change
its state only through ``Registry``, its methods."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from pagedkv.common.logging import get_logger
from pagedkv.scheduler.executor_client import PROBE_TIMEOUT_S, ExecutorClient, ExecutorDown
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.sequence import Sequence
from pagedkv.scheduler.takeover import TakenOver, not_adoptable
from pagedkv.v1 import executor_pb2

log = get_logger(__name__)

PROBE_BACKOFF_S = (0.25, 5.0)  # first and longest wait between probes of a down executor


class Registry(Protocol):
    """What draining and probing read of the executors' registry, and the
    methods through which they change it."""

    @property
    def scheduler_id(self) -> str: ...
    @property
    def info(self) -> executor_pb2.GetInfoResponse: ...  # the model every executor serves
    @property
    def schedulers(self) -> dict[str, ExecutorScheduler]: ...  # executors in service
    @property
    def clients(self) -> dict[str, ExecutorClient]: ...
    @property
    def down(self) -> dict[str, str]: ...  # address -> why

    def new_client(self, address: str) -> ExecutorClient: ...
    async def take_over(
        self, client: ExecutorClient, info: executor_pb2.GetInfoResponse | None = None
    ) -> TakenOver: ...
    def move_elsewhere(self, moved: list[Sequence], why: str) -> None: ...
    def remove_drained(self, scheduler: ExecutorScheduler, why: str) -> None: ...
    def still_down(self, address: str, why: str) -> None: ...
    def taken_back(self, address: str, client: ExecutorClient, taken: TakenOver) -> None: ...


async def drain(executors: Registry, address: str, timeout: float, why: str) -> None:
    """Gives an executor up gracefully: nothing new is admitted there,
    sequences not started there move to the other executors at once,
    running ones get ``timeout`` seconds to finish, then the rest move
    too (recomputed; UNAVAILABLE ``why`` when no executor is left). Returns
    once its step loop has stopped with no step in flight."""
    scheduler = executors.schedulers.get(address)
    if scheduler is None:
        return
    scheduler.start_draining()
    log.info("executor draining", executor=address, running=len(scheduler.running))
    deadline = time.monotonic() + timeout
    while executors.schedulers.get(address) is scheduler:
        idle = scheduler.take_unstarted()
        if idle and len(executors.schedulers) > 1:
            executors.move_elsewhere(idle, why)
        else:
            for seq in idle:
                scheduler.add(seq)
        if not scheduler.running or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    if executors.schedulers.get(address) is not scheduler:
        return  # it went down meanwhile
    executors.remove_drained(scheduler, why)
    await scheduler.stopped.wait()
    log.info("executor given up", executor=address)


async def probe(executors: Registry, address: str) -> None:
    """Probes a down executor with backoff (GetInfo on a fresh channel)
    and takes it back when it answers: a new incarnation as a fresh
    executor, the same one (it hung, or lost its connection) re-adopted
    with a higher epoch and the cache its block tags vouch for (a step in
    flight when it went down either ran before the Reset or never will).
    An executor another owner has taken over is left to that owner; one
    forgotten meanwhile is no longer probed."""
    await executors.clients[address].close()
    delay, longest = PROBE_BACKOFF_S
    while True:
        await asyncio.sleep(delay)
        delay = min(2 * delay, longest)
        if address not in executors.down:
            return  # forgotten
        client = executors.new_client(address)
        try:
            info = await client.get_info(timeout=min(PROBE_TIMEOUT_S, client.timeout))
            why = not_adoptable(info, executors.info.model_id, executors.scheduler_id)
            if why is None:
                taken = await executors.take_over(client, info)
        except ExecutorDown as exc:
            why = str(exc)
        if why is not None:
            executors.still_down(address, why)
            await client.close()
            continue
        executors.taken_back(address, client, taken)
        return
