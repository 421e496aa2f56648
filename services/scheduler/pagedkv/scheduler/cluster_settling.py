"""Whether ``pagedkv serve``'s cluster has settled: ``ClusterView``, the
registry, the live members and the leases read at one moment, says how many
executors each member holds and whether every registered executor is leased
to a live member with none holding two more than another; ``wait_for`` polls
for a view that meets a condition. Reads Redis only, changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from typing import NamedTuple

import redis.asyncio

from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import Lease, LeaseTable
from pagedkv.cluster.members import MemberRecord, Members
from pagedkv.cluster.registry import ExecutorRecord, list_executors


class ClusterView(NamedTuple):
    """The registry, the live members and the leases, read at one moment."""

    executors: list[ExecutorRecord]
    members: list[MemberRecord]
    leases: dict[str, Lease]

    @classmethod
    async def read(cls, client: redis.asyncio.Redis, keys: Keys) -> ClusterView:
        executors = await list_executors(client, keys)
        members = await Members(client, keys).live()
        leases = await LeaseTable(client, keys).read([r.address for r in executors])
        return cls(executors, members, leases)

    def held(self) -> dict[str, int]:
        """Member address -> how many executors it holds."""
        owners = {m.member_id: m.address for m in self.members}
        counts = dict.fromkeys(owners.values(), 0)
        for lease in self.leases.values():
            if lease.owner_id in owners:
                counts[owners[lease.owner_id]] += 1
        return counts

    def settled(self, member_addresses: Collection[str] = ()) -> bool:
        """Every registered executor is leased to a live member, no member
        holds two more than another, and ``member_addresses`` are all live."""
        live = {m.member_id for m in self.members}
        if not live or not set(member_addresses) <= {m.address for m in self.members}:
            return False
        if any(self.leases.get(r.address, _NO_LEASE).owner_id not in live for r in self.executors):
            return False
        counts = self.held().values()
        return max(counts) - min(counts) <= 1


_NO_LEASE = Lease("", "", 0, "")


async def wait_for(
    client: redis.asyncio.Redis, condition: Callable[[ClusterView], bool], timeout: float
) -> ClusterView | None:
    """The first view that meets ``condition``, polled; None after ``timeout``."""
    deadline = time.monotonic() + timeout
    keys = Keys()
    while True:
        view = await ClusterView.read(client, keys)
        if condition(view):
            return view
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.1)
