"""Leases and fencing epochs against a real Redis: acquire / renew / release,
one winner among concurrent acquirers, epochs that never go backwards (also
after Redis restarts empty), exact arithmetic near 2^63 - 1."""

from __future__ import annotations

import asyncio

import pytest

from pagedkv.cluster.connection import connect
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import (
    EpochsExhausted,
    Lease,
    LeaseHeld,
    LeaseLost,
    LeaseTable,
    Renewed,
)
from pagedkv.common.ids import MAX_EPOCH
from tests.cluster.conftest import run
from tests.redis_server import RedisServer

ADDR = "10.0.0.1:7000"
TTL = 60_000


def table(url: str) -> LeaseTable:
    return LeaseTable(connect(url))


def test_acquire_grants_epoch_one_then_refuses_others_naming_the_holder(redis_url: str) -> None:
    async def main() -> None:
        leases = table(redis_url)
        lease = await leases.acquire(ADDR, "s1", "inc-a", 0, TTL)
        assert lease == Lease(ADDR, "s1", 1, "inc-a")
        refused = await leases.acquire(ADDR, "s2", "inc-a", 0, TTL)
        assert refused == LeaseHeld(Lease(ADDR, "s1", 1, "inc-a"))
        assert await leases.read([ADDR, "other:1"]) == {ADDR: lease}
        assert await leases.read_epoch(ADDR) == 1

    run(main())


def test_reacquiring_our_own_lease_takes_a_higher_epoch(redis_url: str) -> None:
    async def main() -> None:
        leases = table(redis_url)
        first = await leases.acquire(ADDR, "s1", "inc-a", 0, TTL)
        again = await leases.acquire(ADDR, "s1", "inc-b", 0, TTL)
        assert (first, again) == (Lease(ADDR, "s1", 1, "inc-a"), Lease(ADDR, "s1", 2, "inc-b"))

    run(main())


def test_min_epoch_raises_the_granted_epoch_and_the_counter(redis_url: str) -> None:
    async def main() -> None:
        leases = table(redis_url)
        assert await leases.acquire(ADDR, "s1", "i", 41, TTL) == Lease(ADDR, "s1", 42, "i")
        assert await leases.release(Lease(ADDR, "s1", 42, "i"))
        # a lower min_epoch never lowers the counter
        assert await leases.acquire(ADDR, "s2", "i", 3, TTL) == Lease(ADDR, "s2", 43, "i")

    run(main())


def test_renew_keeps_the_lease_and_release_frees_it_for_a_higher_epoch(redis_url: str) -> None:
    async def main() -> None:
        leases = table(redis_url)
        lease = await leases.acquire(ADDR, "s1", "i", 0, TTL)
        assert isinstance(lease, Lease)
        assert await leases.renew(lease, TTL) == Renewed(recreated=False)
        assert not await leases.release(lease._replace(epoch=7))  # not ours: kept
        assert not await leases.release(lease._replace(owner_id="s2"))
        assert await leases.release(lease)
        assert await leases.read([ADDR]) == {}
        assert await leases.acquire(ADDR, "s2", "i", 0, TTL) == Lease(ADDR, "s2", 2, "i")
        assert await leases.renew(lease, TTL) == LeaseLost("s2", 2)

    run(main())


def test_an_expired_lease_can_be_taken_and_its_old_holder_has_lost_it(redis_url: str) -> None:
    async def main() -> None:
        leases = table(redis_url)
        old = await leases.acquire(ADDR, "s1", "i", 0, 50)
        assert isinstance(old, Lease)
        while (taken := await leases.acquire(ADDR, "s2", "i", 0, TTL)) != Lease(ADDR, "s2", 2, "i"):
            assert taken == LeaseHeld(old)
            await asyncio.sleep(0.02)
        assert await leases.renew(old, TTL) == LeaseLost("s2", 2)

    run(main())


def test_renew_of_an_absent_lease_after_a_higher_epoch_was_issued_is_lost(redis_url: str) -> None:
    async def main() -> None:
        leases = table(redis_url)
        old = await leases.acquire(ADDR, "s1", "i", 0, TTL)
        assert isinstance(old, Lease)
        await leases.client.delete(Keys().lease(ADDR))
        new = await leases.acquire(ADDR, "s2", "i", 0, TTL)
        assert isinstance(new, Lease)
        assert await leases.release(new)
        assert await leases.renew(old, TTL) == LeaseLost(None, 2)
        assert await leases.read([ADDR]) == {}

    run(main())


def test_concurrent_acquirers_exactly_one_wins(redis_url: str) -> None:
    async def main() -> None:
        contenders = [table(redis_url) for _ in range(16)]
        results = await asyncio.gather(
            *(t.acquire(ADDR, f"s{i}", "i", 0, TTL) for i, t in enumerate(contenders))
        )
        winners = [r for r in results if isinstance(r, Lease)]
        assert len(winners) == 1 and winners[0].epoch == 1
        assert all(r == LeaseHeld(winners[0]) for r in results if r is not winners[0])

    run(main())


def test_after_redis_restarts_empty_min_epoch_keeps_epochs_increasing(
    redis_url: str, redis_server: RedisServer
) -> None:
    async def acquire(owner: str, min_epoch: int) -> Lease:
        lease = await table(redis_url).acquire(ADDR, owner, "i", min_epoch, TTL)
        assert isinstance(lease, Lease)
        return lease

    first = run(acquire("s1", 0))
    assert first.epoch == 1
    redis_server.restart()
    # the executor reports epoch 1 (GetInfo): the next epoch is above it
    second = run(acquire("s2", first.epoch))
    assert second.epoch == 2


def test_renew_after_redis_restarts_empty_recreates_the_lease_and_the_counter(
    redis_url: str, redis_server: RedisServer
) -> None:
    held = run(table(redis_url).acquire(ADDR, "s1", "i", 9, TTL))
    assert held == Lease(ADDR, "s1", 10, "i")
    redis_server.restart()

    async def main() -> None:
        leases = table(redis_url)
        assert await leases.renew(held, TTL) == Renewed(recreated=True)
        assert await leases.read([ADDR]) == {ADDR: held}
        assert await leases.read_epoch(ADDR) == 10
        assert await leases.acquire(ADDR, "s2", "i", 0, TTL) == LeaseHeld(held)

    run(main())


def test_epochs_near_the_maximum_are_exact(redis_url: str) -> None:
    async def main() -> None:
        leases = table(redis_url)
        near = MAX_EPOCH - 2  # not representable as a double
        lease = await leases.acquire(ADDR, "s1", "i", near, TTL)
        assert lease == Lease(ADDR, "s1", MAX_EPOCH - 1, "i")
        assert isinstance(lease, Lease)
        assert await leases.renew(lease, TTL) == Renewed(recreated=False)
        # a neighbouring epoch that a double would round to the same value is not ours
        assert await leases.renew(lease._replace(epoch=MAX_EPOCH - 2), TTL) == LeaseLost(
            "s1", MAX_EPOCH - 1
        )
        assert await leases.release(lease)
        last = await leases.acquire(ADDR, "s1", "i", 0, TTL)
        assert last == Lease(ADDR, "s1", MAX_EPOCH, "i")
        assert isinstance(last, Lease)
        assert await leases.release(last)
        assert await leases.acquire(ADDR, "s2", "i", 0, TTL) == EpochsExhausted(ADDR)
        assert await leases.read_epoch(ADDR) == MAX_EPOCH

    run(main())


def test_renew_recreation_compares_epochs_as_exact_integers(redis_url: str) -> None:
    async def main() -> None:
        leases = table(redis_url)
        await leases.client.set(Keys().epoch(ADDR), str(MAX_EPOCH - 1))
        mine = Lease(ADDR, "s1", MAX_EPOCH - 2, "i")  # below the counter by one
        assert await leases.renew(mine, TTL) == LeaseLost(None, MAX_EPOCH - 1)
        above = Lease(ADDR, "s1", MAX_EPOCH, "i")
        assert await leases.renew(above, TTL) == Renewed(recreated=True)
        assert await leases.read_epoch(ADDR) == MAX_EPOCH

    run(main())


def test_bad_arguments_are_refused_before_redis_is_called(redis_url: str) -> None:
    leases = table(redis_url)
    with pytest.raises(ValueError, match="min_epoch"):
        run(leases.acquire(ADDR, "s1", "i", MAX_EPOCH + 1, TTL))
    with pytest.raises(ValueError, match="owner_id"):
        run(leases.acquire(ADDR, "", "i", 0, TTL))
    with pytest.raises(ValueError, match="ttl_ms"):
        run(leases.acquire(ADDR, "s1", "i", 0, 0))
