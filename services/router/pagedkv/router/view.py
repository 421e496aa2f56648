"""The cluster as a router sees it: one consistent-enough read of Redis.

``read_cluster`` reads the registry, the live scheduler members, the leases
and the members' load reports (a handful of round trips) into a
``ClusterSnapshot``; the router refreshes it every ``--refresh-interval``.
``candidates_of`` turns a snapshot into the executors a request can go to:
registered, leased by a live member that is not routed around, and not
draining, each with its load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import redis.asyncio

from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import Lease, LeaseTable
from pagedkv.cluster.load import ExecutorLoad, read_loads
from pagedkv.cluster.members import MemberRecord, Members
from pagedkv.cluster.registry import ExecutorRecord, list_executors
from pagedkv.router.scoring import Candidate
from pagedkv.v1 import scheduler_pb2


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """An executor's load from its lease holder's report, and the report's time."""

    load: ExecutorLoad
    updated_ms: int  # the reporting scheduler's wall clock


@dataclass(frozen=True)
class ClusterSnapshot:
    records: dict[str, ExecutorRecord] = field(default_factory=dict)  # by address
    leases: dict[str, Lease] = field(default_factory=dict)  # by address
    members: dict[str, MemberRecord] = field(default_factory=dict)  # by member id
    loads: dict[str, ReportedLoad] = field(default_factory=dict)  # by address
    read_at: float = 0.0  # monotonic

    def owner_of(self, address: str) -> MemberRecord | None:
        """The live member holding ``address``'s lease (of the registered
        incarnation), if any."""
        lease = self.leases.get(address)
        record = self.records.get(address)
        if lease is None or record is None:
            return None
        if lease.incarnation_id and lease.incarnation_id != record.incarnation_id:
            return None
        return self.members.get(lease.owner_id)

    def state(self) -> scheduler_pb2.ClusterState:
        """The ``GetStats.cluster`` view of this snapshot."""
        view = scheduler_pb2.ClusterState(enabled=True, scheduler_ids=sorted(self.members))
        for address in sorted(self.records):
            record, lease = self.records[address], self.leases.get(address)
            view.executors.add(
                address=address,
                incarnation_id=record.incarnation_id,
                owner_id=lease.owner_id if lease else "",
                epoch=lease.epoch if lease else 0,
            )
        return view


async def read_cluster(client: redis.asyncio.Redis, keys: Keys) -> ClusterSnapshot:
    """One read of the cluster's control plane; Redis errors propagate."""
    records = await list_executors(client, keys)
    members = await Members(client, keys).live()
    leases = await LeaseTable(client, keys).read([r.address for r in records])
    reports = await read_loads(client, [m.member_id for m in members], keys)
    by_address = {r.address: r for r in records}
    loads: dict[str, ReportedLoad] = {}
    for member_id, report in reports.items():
        for load in report.executors:
            lease, record = leases.get(load.address), by_address.get(load.address)
            if (
                lease is not None
                and lease.owner_id == member_id
                and record is not None
                and record.incarnation_id == load.incarnation_id
            ):
                loads[load.address] = ReportedLoad(load, report.updated_ms)
    return ClusterSnapshot(
        records=by_address,
        leases=leases,
        members={m.member_id: m for m in members},
        loads=loads,
        read_at=time.monotonic(),
    )


def candidates_of(
    snapshot: ClusterSnapshot,
    avoided_members: Container[str],
    correction: Callable[[str, int | None], int],
) -> list[Candidate]:
    """The executors a request can be placed on. ``correction(address,
    updated_ms)``: what the router's own placements add to the load reported
    at that time (``Placements.correction``)."""
    candidates = []
    for address, record in snapshot.records.items():
        owner = snapshot.owner_of(address)
        if owner is None or owner.member_id in avoided_members:
            continue
        reported = snapshot.loads.get(address)
        if reported is None:
            queued, usage = float(correction(address, None)), 0.0
        else:
            load = reported.load
            if load.draining:
                continue
            queued = float(max(0, load.num_queued + correction(address, reported.updated_ms)))
            usable = max(1, load.num_usable_blocks)
            usage = min(1.0, max(0.0, 1.0 - load.num_free_blocks / usable))
        candidates.append(
            Candidate(
                address=address,
                incarnation_id=record.incarnation_id,
                owner_id=owner.member_id,
                num_queued=queued,
                kv_usage=usage,
            )
        )
    return candidates
