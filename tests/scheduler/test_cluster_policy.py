"""Who claims and who gives an executor up, from one member round's reads
(``cluster_policy.py``): exact answers for small clusters."""

from __future__ import annotations

from pagedkv.cluster.leases import Lease
from pagedkv.cluster.members import MemberRecord
from pagedkv.cluster.registry import ExecutorRecord
from pagedkv.scheduler.cluster_policy import (
    cluster_view,
    lease_counts,
    may_claim,
    share,
    to_give_up,
)


def _lease(address: str, owner_id: str, epoch: int = 1) -> Lease:
    return Lease(address, owner_id, epoch, f"inc-{address}")


def test_lease_counts_count_live_members_only_and_this_member_by_what_it_holds() -> None:
    leases = {
        "e1": _lease("e1", "a"),
        "e2": _lease("e2", "a"),
        "e3": _lease("e3", "gone"),  # its member is not live: not counted
        "e4": _lease("e4", "me"),
    }
    assert lease_counts(["a", "b"], leases, "me", 3) == {"a": 2, "b": 0, "me": 3}


def test_the_share_is_rounded_up() -> None:
    assert [share(n, 3) for n in (0, 1, 3, 4, 7)] == [0, 1, 1, 2, 3]


def test_only_the_emptiest_member_below_its_share_claims() -> None:
    assert may_claim({"me": 0, "b": 0}, "me", 2)
    assert not may_claim({"me": 1, "b": 0}, "me", 2)  # another holds fewer
    assert not may_claim({"me": 2, "b": 2}, "me", 2)  # its share is full


def test_the_most_loaded_member_gives_up_its_least_busy_executor() -> None:
    running = {"e1": 3, "e2": 1, "e3": 1}
    assert to_give_up({"me": 3, "b": 1}, "me", running) == "e2"  # first of the least busy
    assert to_give_up({"me": 3, "b": 2}, "me", running) is None  # only one more
    assert to_give_up({"me": 3, "b": 3}, "me", running) is None  # level with the others
    assert to_give_up({"me": 3, "b": 1}, "me", {"e1": 0}) is None  # one in service here


def test_a_tie_for_the_most_loaded_goes_to_the_greatest_member_id() -> None:
    running = {"e1": 0, "e2": 0, "e3": 0}
    assert to_give_up({"me": 3, "zz": 3, "b": 0}, "me", running) is None
    assert to_give_up({"me": 3, "aa": 3, "b": 0}, "me", running) == "e1"


def test_the_cluster_view_lists_members_and_each_executor_s_lease() -> None:
    records = [
        ExecutorRecord("e1", "inc-1", "m", 16, 8, 1024, 4, 128, 0),
        ExecutorRecord("e2", "inc-2", "m", 16, 8, 1024, 4, 128, 0),
    ]
    members = [MemberRecord("b", "h:2", 0), MemberRecord("a", "h:1", 0)]
    view = cluster_view(records, members, {"e1": _lease("e1", "a", 7)})
    assert list(view.scheduler_ids) == ["a", "b"]
    assert [(e.address, e.incarnation_id, e.owner_id, e.epoch) for e in view.executors] == [
        ("e1", "inc-1", "a", 7),
        ("e2", "inc-2", "", 0),
    ]
    assert view.enabled
