"""What a cluster member decides from one round's reads of Redis (the
registry, the live members, the leases): how many executors each member
holds, whether it may claim one more, which executor it gives up to
rebalance, and the ``GetStats.cluster`` view. Pure functions: the member
(``cluster.py``) acts on their answers."""

from __future__ import annotations

import math
from collections.abc import Iterable

from pagedkv.cluster.leases import Lease
from pagedkv.cluster.members import MemberRecord
from pagedkv.cluster.registry import ExecutorRecord
from pagedkv.v1 import scheduler_pb2


def lease_counts(
    member_ids: Iterable[str], leases: dict[str, Lease], member_id: str, num_held: int
) -> dict[str, int]:
    """Executors leased to each live member; ``member_id`` (this member,
    live even if its record is not read yet) holds ``num_held``."""
    counts = dict.fromkeys(member_ids, 0)
    for lease in leases.values():
        if lease.owner_id in counts:
            counts[lease.owner_id] += 1
    counts[member_id] = num_held
    return counts


def share(num_executors: int, num_members: int) -> int:
    """The most executors one member claims: an even share, rounded up."""
    return math.ceil(num_executors / num_members)


def may_claim(counts: dict[str, int], member_id: str, most: int) -> bool:
    """Whether the member may claim one more executor: it holds fewer than
    ``most`` (its share) and no live member holds fewer (the emptiest claims)."""
    mine = counts[member_id]
    return mine < most and mine <= min(counts.values())


def to_give_up(counts: dict[str, int], member_id: str, running: dict[str, int]) -> str | None:
    """The executor the member gives up to rebalance (None: none): only
    when it is the most loaded and holds at least two more than the least
    loaded member, and holds two in service; the one with the fewest
    running sequences (``running``: address -> count, in service here)."""
    most = max(counts, key=lambda m: (counts[m], m))
    if most != member_id or counts[most] < min(counts.values()) + 2:
        return None
    if len(running) < 2:
        return None
    return min(running, key=running.__getitem__)


def cluster_view(
    records: list[ExecutorRecord], members: list[MemberRecord], leases: dict[str, Lease]
) -> scheduler_pb2.ClusterState:
    """The ``GetStats.cluster`` view of one round: the live members and
    every registered executor with its lease holder and epoch."""
    view = scheduler_pb2.ClusterState(
        enabled=True, scheduler_ids=sorted(m.member_id for m in members)
    )
    for record in records:
        lease = leases.get(record.address)
        view.executors.add(
            address=record.address,
            incarnation_id=record.incarnation_id,
            owner_id=lease.owner_id if lease else "",
            epoch=lease.epoch if lease else 0,
        )
    return view
