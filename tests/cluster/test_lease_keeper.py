"""The lease keeper against a real Redis: leases and the member record stay
alive while the event loop is blocked, renewals reach the loop, and a loop
blocked past ``max_loop_stall`` lets its leases expire."""

from __future__ import annotations

import asyncio
import threading
import time

import redis

from pagedkv.cluster.connection import connect, connect_sync
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import Lease, LeaseTable, Renewed, RenewResult
from pagedkv.cluster.members import MemberRecord
from pagedkv.scheduler.lease_keeper import LeaseKeeper, Renewal
from tests.cluster.conftest import run
from tests.redis_server import RedisServer

ADDR = "10.0.0.1:7000"
TTL_MS = 1000
MEMBER = MemberRecord("s1", "127.0.0.1:1", 0)


def block_the_loop(client: redis.Redis, keys: Keys, seconds: float) -> list[tuple[bool, bool]]:
    """Holds the event loop for ``seconds`` (as a long callback would), and
    says every 0.1 s whether the lease and the member record are in Redis
    (from the keeper's first beat on)."""
    while not client.exists(keys.scheduler("s1")):
        time.sleep(0.01)
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.append(
            (bool(client.exists(keys.lease(ADDR))), bool(client.exists(keys.scheduler("s1"))))
        )
        time.sleep(0.1)
    return seen


def keep(
    url: str, max_loop_stall: float, seconds: float
) -> tuple[list[tuple[bool, bool]], list[Renewal]]:
    """A keeper of one lease while the loop is blocked ``seconds``; what
    Redis held meanwhile, and the renewals the loop got after."""
    keys = Keys()

    async def main() -> tuple[list[tuple[bool, bool]], list[Renewal]]:
        lease = await LeaseTable(connect(url), keys).acquire(ADDR, "s1", "inc-a", 0, TTL_MS)
        assert isinstance(lease, Lease)
        renewals: list[Renewal] = []
        keeper = LeaseKeeper(
            connect_sync(url),
            keys,
            member=lambda: MEMBER,
            held={ADDR: lease},
            ttl_ms=TTL_MS,
            beat=TTL_MS / 4000,
            max_loop_stall=max_loop_stall,
            on_renewed=renewals.extend,
            on_error=lambda exc: None,
        )
        keeper.start()
        seen = block_the_loop(connect_sync(url), keys, seconds)
        await asyncio.sleep(TTL_MS / 1000)  # the loop runs: the queued renewals arrive
        keeper.stop()
        return seen, renewals

    return run(main())


def test_a_blocked_loop_keeps_its_lease_and_member_record(
    redis_url: str, redis_server: RedisServer
) -> None:
    seen, renewals = keep(redis_url, max_loop_stall=30.0, seconds=4 * TTL_MS / 1000)
    assert seen and all(lease and member for lease, member in seen)
    assert renewals and all(r.address == ADDR and r.result == Renewed(False) for r in renewals)


def test_a_loop_blocked_past_the_stall_limit_lets_its_lease_expire(
    redis_url: str, redis_server: RedisServer
) -> None:
    seen, renewals = keep(redis_url, max_loop_stall=1.0, seconds=4 * TTL_MS / 1000)
    assert seen[0] == (True, True)
    assert seen[-1] == (False, False)
    # Once the loop runs again, the lease is written back (no other owner took it).
    assert Renewed(recreated=True) in [r.result for r in renewals]
    assert renewals[-1].result == Renewed(recreated=False)


def test_a_lease_released_while_its_renewal_is_in_flight_stays_released(
    redis_url: str, redis_server: RedisServer
) -> None:
    """The loop takes the lease out of ``held`` while a beat's renewal of it
    is on its way to Redis; ``settled`` waits for that beat, so the release
    that follows is not undone by the renewal (which writes back a lease
    whose key is gone)."""
    keys = Keys()
    in_renewal, go_on = threading.Event(), threading.Event()

    async def main() -> None:
        table = LeaseTable(connect(redis_url), keys)
        lease = await table.acquire(ADDR, "s1", "inc-a", 0, TTL_MS)
        assert isinstance(lease, Lease)
        held = {ADDR: lease}
        keeper = LeaseKeeper(
            connect_sync(redis_url),
            keys,
            member=lambda: MEMBER,
            held=held,
            ttl_ms=TTL_MS,
            beat=60.0,  # one beat: the first, at start
            max_loop_stall=30.0,
            on_renewed=lambda renewals: None,
            on_error=lambda exc: None,
        )
        renew = keeper.renewer.renew

        def held_up_renew(lease: Lease, ttl_ms: int) -> RenewResult:
            in_renewal.set()
            go_on.wait(10)
            return renew(lease, ttl_ms)

        keeper.renewer.renew = held_up_renew  # type: ignore[method-assign]
        keeper.start()
        assert await asyncio.to_thread(in_renewal.wait, 10)

        async def release() -> None:  # as ClusterMember._release
            await keeper.settled()
            assert await table.release(lease)

        del held[ADDR]
        releasing = asyncio.create_task(release())
        await asyncio.sleep(0.2)
        go_on.set()  # the renewal reaches Redis
        await asyncio.wait_for(releasing, 10)
        await asyncio.to_thread(keeper.stop)

    run(main())
    assert not connect_sync(redis_url).exists(keys.lease(ADDR))


def test_settled_returns_at_once_between_beats(redis_url: str, redis_server: RedisServer) -> None:
    async def main() -> None:
        keeper = LeaseKeeper(
            connect_sync(redis_url),
            Keys(),
            member=lambda: MEMBER,
            held={},
            ttl_ms=TTL_MS,
            beat=60.0,
            max_loop_stall=30.0,
            on_renewed=lambda renewals: None,
            on_error=lambda exc: None,
        )
        await asyncio.wait_for(keeper.settled(), 1.0)  # before start
        keeper.stop()

    run(main())
