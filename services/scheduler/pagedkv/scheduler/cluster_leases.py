"""The executor leases a cluster member holds: acquired with a fresh epoch
for each takeover, renewed from the lease keeper's thread
(``lease_keeper.py``, which also beats the member record), released once no
renewal can revive them. See docs/cluster.md, "Leases and fencing"."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis.asyncio
import redis.exceptions

from pagedkv.cluster.connection import connect_sync
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import EpochsExhausted, Lease, LeaseHeld, LeaseTable, Renewed
from pagedkv.cluster.members import MemberRecord
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.executor_client import ExecutorDown
from pagedkv.scheduler.lease_keeper import LeaseKeeper, Renewal
from pagedkv.v1 import executor_pb2

log = get_logger(__name__)

REDIS_ERRORS = (redis.exceptions.RedisError, OSError)

MAX_LOOP_STALL_TTLS = 4
"""Lease TTLs the event loop may not run before the leases are left to
expire (``lease_keeper.py``): a hung scheduler gives its executors up."""


class HeldLeases:
    """The leases held (``held``: address -> lease) and until when each is
    known to be ours (``valid_until``, monotonic: the executor's steps stop
    after it). Only its methods change them; the keeper's thread reads
    ``held`` and its answers are applied on the loop (``_renewed``)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        redis_url: str,
        keys: Keys,
        member_id: str,
        lease_ttl: float,
        member_record: Callable[[], MemberRecord],
        on_lost: Callable[[str, str], None],
        on_renewals: Callable[[], None],
    ) -> None:
        self.table = LeaseTable(client, keys)
        self.member_id = member_id
        self.lease_ttl = lease_ttl
        self.ttl_ms = max(1, int(lease_ttl * 1000))
        self.held: dict[str, Lease] = {}
        self.valid_until: dict[str, float] = {}
        self.on_lost = on_lost  # (address, why): a renewal found the lease taken
        self.on_renewals = on_renewals  # a beat's renewals were applied
        self.keeper = LeaseKeeper(
            connect_sync(redis_url),
            keys,
            member=member_record,
            held=self.held,
            ttl_ms=self.ttl_ms,
            beat=lease_ttl / 4,
            max_loop_stall=MAX_LOOP_STALL_TTLS * lease_ttl,
            on_renewed=self._renewed,
            on_error=self._renewals_failed,
        )

    def valid(self, address: str) -> bool:
        """Whether the executor's lease is known to be ours now."""
        return time.monotonic() < self.valid_until.get(address, 0.0)

    async def acquire(self, address: str, info: executor_pb2.GetInfoResponse) -> int:
        """Acquires the executor's lease with a fresh epoch (above its
        current epoch) and returns it. Raises ExecutorDown ``refused`` when
        another member holds it or Redis cannot be reached (nothing held then)."""
        try:
            result = await self.table.acquire(
                address, self.member_id, info.incarnation_id, info.owner.epoch, self.ttl_ms
            )
        except REDIS_ERRORS as exc:
            raise ExecutorDown("refused", f"{address}: no lease: redis unreachable: {exc}") from exc
        if isinstance(result, LeaseHeld):
            holder = result.holder
            raise ExecutorDown(
                "refused", f"{address}: leased to {holder.owner_id!r} at epoch {holder.epoch}"
            )
        if isinstance(result, EpochsExhausted):
            raise ExecutorDown("refused", f"{address}: its epochs are exhausted; restart it")
        self.held[address] = result
        self.valid_until[address] = time.monotonic() + 0.75 * self.lease_ttl
        return result.epoch

    def drop(self, address: str) -> Lease | None:
        """Stops holding the executor's lease (no more renewals); returns it
        to be released (None: not held)."""
        self.valid_until.pop(address, None)
        return self.held.pop(address, None)

    async def release(self, lease: Lease) -> None:
        """Releases ``lease``, already dropped, once the lease keeper can no
        longer renew it (``LeaseKeeper.settled``): a renewal after the
        release would write it back for a TTL."""
        await self.keeper.settled()
        await self.table.release(lease)

    def _renewed(self, renewals: list[Renewal]) -> None:
        """Applies a beat's renewals (on the loop): a renewed lease is valid
        for 3/4 of a TTL from when it was sent; a lost one is dropped and
        ``on_lost`` puts its executor out of service at once."""
        for address, lease, sent, result in renewals:
            if self.held.get(address) is not lease:
                continue  # released or re-acquired meanwhile
            if isinstance(result, Renewed):
                self.valid_until[address] = sent + 0.75 * self.lease_ttl
                if result.recreated:
                    log.info("lease restored", executor=address, epoch=lease.epoch)
                continue
            why = f"lease lost to {result.holder_id!r} (epoch {result.epoch})"
            log.warning("lease lost", executor=address, holder=result.holder_id, epoch=result.epoch)
            self.drop(address)
            self.on_lost(address, why)
        self.on_renewals()

    def _renewals_failed(self, exc: Exception) -> None:
        """A beat could not reach Redis: the member round says whether the
        member is degraded; the steps wait for it."""
        log.debug("lease renewals failed", error=str(exc))
