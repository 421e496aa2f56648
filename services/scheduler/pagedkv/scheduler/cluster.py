"""The scheduler as a member of a cluster whose control plane is Redis
(``--redis-url``; see docs/cluster.md).

``ClusterMember`` runs one background task that, every ``lease_ttl / 4``
seconds: reads the registry, the members and the leases, claims unleased
executors up to its share, and gives one executor up (draining it first)
when it holds more than its share while another member holds fewer. The
member record's heartbeat and the renewals of the leases it holds run on a
thread of their own at the same pace (``lease_keeper.py``), so that a busy
event loop cannot let them lapse. The step loops never await Redis: they
only ask ``may_step``, which is a dict lookup. The leases held:
``cluster_leases.py``; who claims and who gives up, from a round's reads:
``cluster_policy.py``; the prefix caches and loads published for the
routers: ``cluster_feeds.py``.

Leases and fencing: every takeover gets its epoch from the executor's lease
(``epoch_for``), so an executor is only ever Reset with an epoch Redis
handed out, above the executor's own. A lease that cannot be renewed in time
stops the steps to that executor until the renewal answers; a renewal that
finds the lease taken (a paused scheduler whose lease expired) puts the
executor out of service here at once. While Redis cannot be reached the
member is *degraded*: it keeps stepping what it holds (the executors' fencing
still protects them), claims nothing, and restores its records and leases
when Redis answers again, even empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

from pagedkv.cluster.connection import connect, redacted
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import Lease
from pagedkv.cluster.load import ExecutorLoad, LoadPublisher
from pagedkv.cluster.members import MemberRecord, Members
from pagedkv.cluster.mirror import PrefixMirror
from pagedkv.cluster.registry import ExecutorRecord, list_executors
from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.common.tasks import cancel_and_wait
from pagedkv.scheduler import cluster_policy as policy
from pagedkv.scheduler.cluster_feeds import MirroredCaches, executor_loads
from pagedkv.scheduler.cluster_leases import REDIS_ERRORS, HeldLeases
from pagedkv.scheduler.config import ClusterConfig
from pagedkv.scheduler.executor_client import PROBE_TIMEOUT_S, ExecutorClient, ExecutorDown
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.takeover import TakenOver
from pagedkv.v1 import executor_pb2, scheduler_pb2

log = get_logger(__name__)


class ClusterHost(Protocol):
    """What the cluster member needs of the scheduler it is part of (the
    executors' registry, ``executors.py``): its executors in service and
    down, their connections, the model they serve, whether the scheduler is
    stopping, and the paths that take an executor over, give it up or put it
    out of service. The member reads these and never writes them."""

    @property
    def scheduler_id(self) -> str: ...
    @property
    def draining(self) -> bool: ...  # the scheduler is stopping
    @property
    def info(self) -> executor_pb2.GetInfoResponse: ...  # the model every executor serves
    @property
    def schedulers(self) -> dict[str, ExecutorScheduler]: ...  # executors in service
    @property
    def clients(self) -> dict[str, ExecutorClient]: ...
    @property
    def down(self) -> dict[str, str]: ...  # address -> why

    def internal_error(self, exc: BaseException, where: str) -> ServiceError: ...
    def new_client(self, address: str) -> ExecutorClient: ...
    async def take_over(
        self, client: ExecutorClient, info: executor_pb2.GetInfoResponse | None = None
    ) -> TakenOver: ...
    def adopt_claimed(self, address: str, client: ExecutorClient, taken: TakenOver) -> None: ...
    def lose_executor(self, address: str, why: str) -> None: ...
    def executor_down(self, address: str, why: str, cause: str) -> None: ...
    async def drain_executor(self, address: str, timeout: float, why: str) -> None: ...
    async def forget(self, address: str) -> None: ...


class ClusterMember:
    """One scheduler's membership, leases and claims (see the module docstring)."""

    def __init__(self, host: ClusterHost, config: ClusterConfig) -> None:
        self.host = host
        self.config = config
        self.member_id = host.scheduler_id
        self.address = config.address  # the port bound, also for --port 0 (never 0)
        self.redis = connect(config.redis_url)
        self.keys = Keys(config.prefix)
        self.leases = HeldLeases(
            self.redis,
            config.redis_url,
            self.keys,
            self.member_id,
            config.lease_ttl,
            member_record=self._member_record,
            on_lost=self._lease_lost,
            on_renewals=self._wake_steps,
        )
        self.members = Members(self.redis, self.keys)
        self.mirror = PrefixMirror(self.redis, self.keys)
        self.load = LoadPublisher(self.redis, self.member_id, self._loads, self.keys)
        self.caches = MirroredCaches(self.mirror)
        self.beat = config.lease_ttl / 4
        self.degraded: str | None = None
        self.leaving = False
        self.view = scheduler_pb2.ClusterState(enabled=True)
        self.registry: dict[str, ExecutorRecord] = {}
        self.incarnations: dict[str, str] = {}  # address -> last registered incarnation
        self._boot_id: str | None = None
        self._quiet_until = 0.0  # monotonic: no takeover of another member's executor before
        self._no_claims_until = 0.0  # monotonic: set after giving an executor up
        self._drain: asyncio.Task[None] | None = None
        self._round_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._registered_at_ms = int(time.time() * 1000)
        self.num_rounds = 0
        self.num_redis_errors = 0

    @property
    def held(self) -> dict[str, Lease]:
        """The leases held (address -> lease)."""
        return self.leases.held

    # -- life -----------------------------------------------------------------

    async def start(self) -> None:
        """Starts the lease keeper, runs a first round (claims included) and
        starts the member task."""
        self.mirror.start()
        self.load.start()
        self.leases.keeper.start()
        await self._guarded_round()
        self._task = asyncio.create_task(self._run())

    async def leave(self, drain_timeout: float) -> None:
        """A clean exit: drains every executor (running requests get
        ``drain_timeout`` seconds), releases the leases and the member record."""
        self.leaving = True
        if self._drain is not None:
            await asyncio.gather(self._drain, return_exceptions=True)
        why = "the scheduler is stopping"
        await asyncio.gather(
            *(self.give_up(a, drain_timeout, why) for a in list(self.held)),
            return_exceptions=True,
        )
        await self.close()

    async def close(self) -> None:
        """Stops the member task and the lease keeper, and leaves the member
        set (leases left to expire)."""
        await cancel_and_wait([self._task])
        await asyncio.to_thread(self.leases.keeper.stop)
        await self.mirror.close()
        await self.load.close()
        with contextlib.suppress(*REDIS_ERRORS):
            await self.members.leave(self.member_id)
        await self.redis.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.beat)
            await self._guarded_round()

    async def _guarded_round(self) -> None:
        try:
            await self._round()
        except REDIS_ERRORS as exc:
            self.num_redis_errors += 1
            if self.degraded is None:
                log.warning("cluster state degraded: redis unreachable", error=str(exc))
            self.degraded = f"redis at {redacted(self.config.redis_url)} unreachable: {exc}"
            self.view.degraded, self.view.detail = True, self.degraded
        except Exception as exc:  # a bug of ours: the next round tries again
            self.host.internal_error(exc, "cluster round")
        finally:
            self.num_rounds += 1
            self._wake_steps()

    def _wake_steps(self) -> None:
        """Step loops waiting in ``lease_renewed`` look at their lease again."""
        self._round_done.set()
        self._round_done = asyncio.Event()

    # -- the step loops' view ---------------------------------------------------

    def may_step(self, address: str) -> bool:
        """Whether the executor's lease is known to be ours now (or Redis is
        unreachable, where fencing alone protects it)."""
        return self.degraded is not None or self.leases.valid(address)

    async def lease_renewed(self, address: str) -> None:
        """Waits for the next renewals or member round (the lease renewed or
        lost, or Redis found unreachable)."""
        await self._round_done.wait()

    async def epoch_for(self, address: str, info: executor_pb2.GetInfoResponse) -> int:
        """A fresh lease epoch for a takeover of the executor (``HeldLeases.acquire``)."""
        return await self.leases.acquire(address, info)

    def lost(self, address: str) -> None:
        """The executor is no longer ours (fenced by another owner, or given up)."""
        self.leases.drop(address)
        self.caches.lost(address)

    def _lease_lost(self, address: str, why: str) -> None:
        """A renewal found the lease taken: the executor leaves service here."""
        self.lost(address)
        self.host.lose_executor(address, why)

    def adopted(self, scheduler: ExecutorScheduler) -> None:
        """An executor just taken over: its prefix cache is mirrored from here."""
        self.caches.adopted(scheduler)

    def _loads(self) -> list[ExecutorLoad]:
        """The load of each executor held and in service (for routers)."""
        return executor_loads(self.held, self.host.schedulers, self.host.draining)

    # -- one round ------------------------------------------------------------

    async def _round(self) -> None:
        boot = await self.members.ensure_boot()
        seconds, micros = await self.redis.time()
        since_boot = seconds + micros / 1e6 - boot.created_ms / 1000
        if since_boot < self.config.lease_ttl:
            # Redis (re)started empty moments ago: the members that held
            # executors have not restored their leases yet.
            self._quiet_until = time.monotonic() + self.config.lease_ttl - since_boot
        if self._boot_id is not None and boot.boot_id != self._boot_id:
            log.warning("redis lost its data; restoring the cluster state")
            self.mirror.resync()
        self._boot_id = boot.boot_id
        records = await list_executors(self.redis, self.keys)
        members = await self.members.live()
        leases = await self.leases.table.read([r.address for r in records])
        if self.degraded is not None:
            log.info("cluster state restored")
        self.degraded = None
        self._update_view(records, members, leases)
        await self._check_in_service()
        await self._forget_unregistered()
        if self.leaving:
            return
        await self._claim(records, members, leases)
        self._balance(records, members, leases)

    def _member_record(self) -> MemberRecord:
        return MemberRecord(self.member_id, self.address, self._registered_at_ms)

    def _update_view(
        self, records: list[ExecutorRecord], members: list[MemberRecord], leases: dict[str, Lease]
    ) -> None:
        self.registry = {r.address: r for r in records}
        current = {r.address: r.incarnation_id for r in records}
        quiet = time.monotonic() < self._quiet_until
        serving = {a: s.info.incarnation_id for a, s in self.host.schedulers.items()}
        for address, incarnation in self.incarnations.items():
            registered = current.get(address)
            if registered == incarnation:
                continue
            if registered is None and (quiet or serving.get(address) == incarnation):
                # Maybe not ended: Redis restarted empty moments ago (its record
                # comes back at its next heartbeat), or it is in service here
                # (``_check_in_service`` asks it).
                current[address] = incarnation
                continue
            self.mirror.drop(incarnation)  # that incarnation ended
        self.incarnations = current
        self.view = policy.cluster_view(records, members, leases)

    async def _check_in_service(self) -> None:
        """Executors in service here that the registry does not show as that
        incarnation (restarted on the address, or gone: unregistered, or its
        record expired) and that do not answer as it are marked down (an idle
        one would only be found dead by its next step): then probed, so a new
        incarnation is taken back, and one that left is forgotten. One that
        answers as itself stays (Redis lost its record: it registers again);
        in the first lease TTL after Redis started empty a missing record is
        not even asked about."""
        host = self.host
        quiet = time.monotonic() < self._quiet_until
        for address, scheduler in list(host.schedulers.items()):
            record = self.registry.get(address)
            incarnation = scheduler.info.incarnation_id
            if record is not None and record.incarnation_id == incarnation:
                continue
            if record is None and quiet:
                continue  # Redis restarted empty moments ago: records come back

            try:
                info = await host.clients[address].get_info(timeout=self.beat)
                if info.incarnation_id == incarnation:
                    continue
                why = f"transport: {address} restarted (incarnation {info.incarnation_id})"
            except ExecutorDown as exc:
                why = str(exc)
            if host.schedulers.get(address) is scheduler:
                host.executor_down(address, why, "transport")

    async def _forget_unregistered(self) -> None:
        """Executors that left the registry while down here: lease released."""
        for address in list(self.held):
            if address not in self.registry and address in self.host.down:
                lease = self.leases.drop(address)
                if lease is not None:
                    await self.leases.release(lease)
                await self.host.forget(address)
                log.info("executor left the cluster", executor=address)

    async def _claim(
        self, records: list[ExecutorRecord], members: list[MemberRecord], leases: dict[str, Lease]
    ) -> None:
        """Takes unleased executors while this member holds fewer than its
        share and no live member holds fewer (so the emptiest member claims)."""
        if time.monotonic() < self._no_claims_until:
            return
        live = {m.member_id for m in members} | {self.member_id}
        counts = policy.lease_counts(live, leases, self.member_id, len(self.held))
        most = policy.share(len(records), len(live))
        for record in records:
            if not policy.may_claim(counts, self.member_id, most):
                return
            address = record.address
            if address in leases or address in self.host.clients:
                continue
            if await self._claim_one(record):
                counts[self.member_id] += 1

    async def _claim_one(self, record: ExecutorRecord) -> bool:
        host = self.host
        address = record.address
        client = host.new_client(address)
        try:
            info = await client.get_info(timeout=PROBE_TIMEOUT_S)
            owner = info.owner.owner_id
            if owner and owner != self.member_id and time.monotonic() < self._quiet_until:
                raise ExecutorDown(
                    "refused", f"{address}: its owner {owner!r} may still restore its lease"
                )
            if host.info.model_id and info.model_id != host.info.model_id:
                raise ExecutorDown("refused", f"{address}: serves {info.model_id!r}")
            if info.draining:
                raise ExecutorDown("refused", f"{address}: it is stopping")
            taken = await host.take_over(client, info)
        except ExecutorDown as exc:
            await client.close()
            lease = self.leases.drop(address)
            if lease is not None:
                await self.leases.release(lease)
            log.debug("executor not claimed", executor=address, why=str(exc))
            return False
        host.adopt_claimed(address, client, taken)
        return True

    def _balance(
        self, records: list[ExecutorRecord], members: list[MemberRecord], leases: dict[str, Lease]
    ) -> None:
        """Gives one executor up when this member is the most loaded and holds
        at least two more than the least loaded live member."""
        if self._drain is not None and not self._drain.done():
            return
        if any(r.address not in leases for r in records):
            return  # executors are still to be claimed
        member_ids = (m.member_id for m in members)
        counts = policy.lease_counts(member_ids, leases, self.member_id, len(self.held))
        schedulers = self.host.schedulers
        running = {a: len(schedulers[a].running) for a in self.held if a in schedulers}
        address = policy.to_give_up(counts, self.member_id, running)
        if address is None:
            return
        log.info("rebalancing: giving an executor up", executor=address, held=len(self.held))
        self._drain = asyncio.create_task(
            self.give_up(address, self.config.drain_timeout, "rebalanced to another scheduler")
        )

    async def give_up(self, address: str, timeout: float, why: str) -> None:
        await self.host.drain_executor(address, timeout, why)
        lease = self.leases.drop(address)
        self._no_claims_until = time.monotonic() + 2 * self.config.lease_ttl
        if lease is not None:
            try:
                await self.leases.release(lease)
            except REDIS_ERRORS as exc:
                log.warning("lease not released (it expires)", executor=address, error=str(exc))
        await self.host.forget(address)
        log.info("executor released", executor=address)
