"""Leases on executors with fencing epochs, as atomic Lua scripts.

A scheduler owns an executor while it holds ``P:lease:{addr}`` (owner_id,
epoch, incarnation_id; expires unless renewed). Every acquisition takes a new
epoch from ``P:epoch:{addr}``: ``max(counter, min_epoch) + 1``, stored back,
so epochs handed out for an address strictly increase. The counter never
expires; after Redis restarted empty, ``min_epoch`` (the executor's current
epoch from GetInfo) keeps the next epoch above every epoch the executor has
seen, and a holder's ``renew`` puts its lease and epoch back.

Epochs are uint64 up to ``MAX_EPOCH`` (2^63 - 1). Lua numbers are doubles, so
the scripts never turn an epoch into a number: they compare decimal strings
(by length, then bytewise) and count with INCR on the stored string.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import redis
import redis.asyncio

from pagedkv.cluster.connection import text
from pagedkv.cluster.keys import Keys
from pagedkv.common.ids import MAX_EPOCH

_GT = """
local function gt(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
"""

# KEYS: lease, counter; ARGV: owner_id, incarnation_id, min_epoch, ttl_ms, MAX_EPOCH.
# {1, epoch} granted; {0, holder, epoch, incarnation} held by another;
# {-1, counter} no epoch left.
_ACQUIRE = (
    _GT
    + """
local holder = redis.call('HMGET', KEYS[1], 'owner_id', 'epoch', 'incarnation_id')
if holder[1] and holder[1] ~= ARGV[1] then
  return {0, holder[1], holder[2] or '0', holder[3] or ''}
end
local counter = redis.call('GET', KEYS[2]) or '0'
if gt(ARGV[3], counter) then
  counter = ARGV[3]
end
if counter == ARGV[5] then
  return {-1, counter}
end
redis.call('SET', KEYS[2], counter)
redis.call('INCR', KEYS[2])
local epoch = redis.call('GET', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner_id', ARGV[1], 'epoch', epoch, 'incarnation_id', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, epoch}
"""
)

# KEYS: lease, counter; ARGV: owner_id, epoch, incarnation_id, ttl_ms.
# {1, 0} renewed; {1, 1} re-created (the lease was gone, no higher epoch issued);
# {0, holder, epoch} lost (holder '' when only the counter is higher).
_RENEW = (
    _GT
    + """
local holder = redis.call('HMGET', KEYS[1], 'owner_id', 'epoch')
if holder[1] then
  if holder[1] == ARGV[1] and holder[2] == ARGV[2] then
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    return {1, 0}
  end
  return {0, holder[1], holder[2] or '0'}
end
local counter = redis.call('GET', KEYS[2]) or '0'
if gt(counter, ARGV[2]) then
  return {0, '', counter}
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'owner_id', ARGV[1], 'epoch', ARGV[2], 'incarnation_id', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, 1}
"""
)

# KEYS: lease; ARGV: owner_id, epoch. 1 if the lease was ours and is deleted.
_RELEASE = """
local holder = redis.call('HMGET', KEYS[1], 'owner_id', 'epoch')
if holder[1] == ARGV[1] and holder[2] == ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class Lease(NamedTuple):
    """A lease on the executor at ``address``: held by ``owner_id`` with
    fencing epoch ``epoch`` over incarnation ``incarnation_id``."""

    address: str
    owner_id: str
    epoch: int
    incarnation_id: str


class LeaseHeld(NamedTuple):
    """An acquisition refused: ``holder`` holds the lease."""

    holder: Lease


class EpochsExhausted(NamedTuple):
    """An acquisition refused: the counter (or ``min_epoch``) is ``MAX_EPOCH``."""

    address: str


class Renewed(NamedTuple):
    """The lease is ours for another TTL; ``recreated`` when it had vanished
    (expired, or Redis restarted empty) and was written back."""

    recreated: bool


class LeaseLost(NamedTuple):
    """The lease is no longer ours: ``holder_id`` holds it with ``epoch``, or
    (``holder_id`` None) no one does but ``epoch`` was issued after ours."""

    holder_id: str | None
    epoch: int


AcquireResult = Lease | LeaseHeld | EpochsExhausted
RenewResult = Renewed | LeaseLost


def _check(owner_id: str, ttl_ms: int) -> None:
    if not owner_id:
        raise ValueError("owner_id: required")
    if ttl_ms <= 0:
        raise ValueError(f"ttl_ms: {ttl_ms} is not positive")


def _renew_call(keys: Keys, lease: Lease, ttl_ms: int) -> tuple[list[str], list[str]]:
    """The renew script's KEYS and ARGV."""
    _check(lease.owner_id, ttl_ms)
    return (
        [keys.lease(lease.address), keys.epoch(lease.address)],
        [lease.owner_id, str(lease.epoch), lease.incarnation_id, str(ttl_ms)],
    )


def _renew_result(reply: Any) -> RenewResult:
    if reply[0] == 1:
        return Renewed(recreated=reply[1] == 1)
    holder = text(reply[1])
    return LeaseLost(holder or None, int(reply[2]))


class LeaseRenewer:
    """``LeaseTable.renew`` through a synchronous client, for a thread that
    renews while the event loop is busy (one atomic script a call; a Redis
    error propagates)."""

    def __init__(self, client: redis.Redis, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self._renew = client.register_script(_RENEW)

    def renew(self, lease: Lease, ttl_ms: int) -> RenewResult:
        """As ``LeaseTable.renew``."""
        keys, args = _renew_call(self.keys, lease, ttl_ms)
        return _renew_result(self._renew(keys=keys, args=args))


class LeaseTable:
    """The leases of one cluster (``keys``) through one asyncio client. Each
    call is one atomic script; a Redis error propagates (the caller decides
    what an unreachable Redis means, e.g. stop stepping before the TTL ends)."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    async def acquire(
        self, address: str, owner_id: str, incarnation_id: str, min_epoch: int, ttl_ms: int
    ) -> AcquireResult:
        """Takes the lease if no one holds it (or ``owner_id`` already does)
        with epoch ``max(counter, min_epoch) + 1``, which becomes the counter."""
        _check(owner_id, ttl_ms)
        if not 0 <= min_epoch <= MAX_EPOCH:
            raise ValueError(f"min_epoch: {min_epoch} is not in [0, {MAX_EPOCH}]")
        reply = await self._acquire(
            keys=[self.keys.lease(address), self.keys.epoch(address)],
            args=[owner_id, incarnation_id, str(min_epoch), str(ttl_ms), str(MAX_EPOCH)],
        )
        if reply[0] == 1:
            return Lease(address, owner_id, int(reply[1]), incarnation_id)
        if reply[0] == -1:
            return EpochsExhausted(address)
        return LeaseHeld(Lease(address, text(reply[1]), int(reply[2]), text(reply[3])))

    async def renew(self, lease: Lease, ttl_ms: int) -> RenewResult:
        """Extends ``lease`` by ``ttl_ms``. When its key is gone, writes it back
        (and raises the counter to ``lease.epoch``) unless a higher epoch was
        issued meanwhile; a lease another owner or epoch holds is lost."""
        keys, args = _renew_call(self.keys, lease, ttl_ms)
        reply = await self._renew(keys=keys, args=args)
        return _renew_result(reply)

    async def release(self, lease: Lease) -> bool:
        """Deletes the lease if it is still ``lease`` (owner and epoch); True if so.
        The epoch counter stays."""
        released = await self._release(
            keys=[self.keys.lease(lease.address)], args=[lease.owner_id, str(lease.epoch)]
        )
        return bool(released == 1)

    async def read(self, addresses: list[str]) -> dict[str, Lease]:
        """The current leases of ``addresses`` (absent ones left out)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for address in addresses:
                pipe.hmget(self.keys.lease(address), ["owner_id", "epoch", "incarnation_id"])
            replies = await pipe.execute()
        leases: dict[str, Lease] = {}
        for address, (owner_id, epoch, incarnation_id) in zip(addresses, replies, strict=True):
            if owner_id is not None:
                leases[address] = Lease(
                    address, text(owner_id), int(epoch or 0), text(incarnation_id or b"")
                )
        return leases

    async def read_epoch(self, address: str) -> int:
        """The epoch counter of ``address`` (0 when none was ever issued)."""
        value = await self.client.get(self.keys.epoch(address))
        return int(value) if value is not None else 0
