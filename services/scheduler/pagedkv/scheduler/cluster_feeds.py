"""What a cluster member publishes to Redis for the routers (docs/cluster.md):
its executors' prefix caches (``MirroredCaches``: each executor in service
here is mirrored as its current incarnation, from a snapshot of its index
and then its cache events, converted here to the shared ``KVEvent``s) and
their loads (``executor_loads``)."""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.cluster.keys import host_tier_incarnation
from pagedkv.cluster.kv_events import KVEvent, Removed, Stored
from pagedkv.cluster.load import ExecutorLoad
from pagedkv.cluster.mirror import PrefixMirror
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler


class MirroredCaches:
    """Which incarnation is mirrored for each executor (``mirrored``); only
    its methods change it and what ``mirror`` tracks."""

    def __init__(self, mirror: PrefixMirror) -> None:
        self.mirror = mirror
        self.mirrored: dict[str, str] = {}  # address -> incarnation mirrored from here

    def adopted(self, scheduler: ExecutorScheduler) -> None:
        """An executor just taken over: its prefix cache is mirrored from here
        (resynced from the index first), its host tier's index too (under
        ``host_tier_incarnation``), and an earlier incarnation's keys go."""
        address, incarnation = scheduler.address, scheduler.info.incarnation_id
        previous = self.mirrored.get(address)
        if previous is not None and previous != incarnation:
            self.mirror.drop(previous)
            self.mirror.drop(host_tier_incarnation(previous))
        self.mirrored[address] = incarnation
        pool, host = scheduler.kv.pool, scheduler.kv.host

        def snapshot(_: str) -> list[Stored]:
            return [
                Stored(block.block_id, block_hash, group_id)
                for group_id, index in enumerate(pool.cached_blocks)
                for block_hash, block in index.items()
            ]

        def record(events: list[CacheEvent]) -> None:
            self.mirror.record(incarnation, map(kv_event, events))

        self.mirror.track(incarnation, snapshot)
        if host is None:
            scheduler.listen_cache_events(record)
            return
        on_host = host_tier_incarnation(incarnation)

        def host_snapshot(_: str) -> list[Stored]:
            return [Stored(host_id, block_hash, 0) for block_hash, host_id in host.cached()]

        def record_host(events: list[CacheEvent]) -> None:
            self.mirror.record(on_host, map(kv_event, events))

        self.mirror.track(on_host, host_snapshot)
        scheduler.listen_cache_events(record, record_host)

    def lost(self, address: str) -> None:
        """The executor is no longer ours: its mirroring from here stops."""
        incarnation = self.mirrored.pop(address, None)
        if incarnation is not None:
            self.mirror.untrack(incarnation)
            self.mirror.untrack(host_tier_incarnation(incarnation))


def kv_event(event: CacheEvent) -> KVEvent:
    """The shared form of a scheduler's cache event."""
    if event.kind is CacheEventKind.STORED:
        return Stored(event.block_id, event.block_hash, event.group_id)
    return Removed(event.block_id, event.block_hash, event.group_id)


def executor_loads(
    held: Iterable[str], schedulers: dict[str, ExecutorScheduler], draining: bool
) -> list[ExecutorLoad]:
    """The load of each executor held and in service (``draining``: the
    scheduler is stopping, so every executor is)."""
    loads = []
    for address in held:
        scheduler = schedulers.get(address)
        if scheduler is None:
            continue
        loads.append(
            ExecutorLoad(
                address=address,
                incarnation_id=scheduler.info.incarnation_id,
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                num_free_blocks=scheduler.kv.pool.get_num_free_blocks(),
                num_usable_blocks=scheduler.info.num_blocks - 1,
                draining=scheduler.draining or draining,
            )
        )
    return loads
