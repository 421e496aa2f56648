"""Scheduler membership and the boot marker against a real Redis."""

from __future__ import annotations

import asyncio

from pagedkv.cluster.connection import connect
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.members import MemberRecord, Members
from tests.cluster.conftest import run
from tests.redis_server import RedisServer

A = MemberRecord("sched-a", "127.0.0.1:9001", 1)
B = MemberRecord("sched-b", "127.0.0.1:9002", 2)


def test_members_join_expire_and_leave(redis_url: str) -> None:
    async def main() -> None:
        members = Members(connect(redis_url))
        await members.heartbeat(A, 60_000)
        await members.heartbeat(B, 30)
        while await members.live() != [A]:  # B's record expires
            await asyncio.sleep(0.02)
        assert await members.client.smembers(Keys().schedulers()) == {b"sched-a"}
        await members.leave("sched-a")
        assert await members.live() == []
        assert await members.client.exists(Keys().scheduler("sched-a")) == 0

    run(main())


def test_boot_marker_is_created_once_and_changes_when_redis_restarts_empty(
    redis_url: str, redis_server: RedisServer
) -> None:
    first = run(Members(connect(redis_url)).ensure_boot())
    again = run(Members(connect(redis_url)).ensure_boot())
    assert first.created_now and not again.created_now
    assert (again.boot_id, again.created_ms) == (first.boot_id, first.created_ms)
    time_ms = int(redis_server.client().time()[0]) * 1000
    assert abs(first.created_ms - time_ms) < 60_000
    redis_server.restart()
    after = run(Members(connect(redis_url)).ensure_boot())
    assert after.created_now and after.boot_id != first.boot_id


def test_member_record_round_trips_through_json() -> None:
    assert MemberRecord.from_json(A.to_json()) == A
