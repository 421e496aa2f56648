"""Scheduler membership and the boot marker (asyncio).

A scheduler is a member while its ``MemberRecord`` lives under
``P:scheduler:{member}`` (a TTL it refreshes with ``heartbeat``) and its id is
in ``P:schedulers``. Member ids are unique per process (a scheduler that was
fenced out rejoins under a new id), so no call compares before it writes.

The boot marker ``P:boot`` (a random id and Redis's own clock at creation)
never expires: a member that finds a boot id other than the one it saw last
knows Redis restarted without its data, and re-creates what it owns.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from typing import NamedTuple

import redis
import redis.asyncio

from pagedkv.cluster.connection import live_records, text
from pagedkv.cluster.keys import Keys


@dataclass(frozen=True)
class MemberRecord:
    """A live scheduler: its member id and the address its Scheduler API serves on."""

    member_id: str
    address: str
    registered_at_ms: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, value: str | bytes) -> MemberRecord:
        """ValueError when ``value`` is not a member record."""
        try:
            record = cls(**json.loads(value))
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a member record: {exc}") from None
        if not (
            isinstance(record.member_id, str)
            and isinstance(record.address, str)
            and type(record.registered_at_ms) is int
        ):
            raise ValueError(f"not a member record: {record!r}")
        return record


class BootMarker(NamedTuple):
    """Redis's boot marker; ``created_now`` when this call created it."""

    boot_id: str
    created_ms: int
    created_now: bool


# KEYS: boot; ARGV: a fresh boot id. {boot_id, created_ms, 1 if created now}.
_ENSURE_BOOT = """
local marker = redis.call('HMGET', KEYS[1], 'boot_id', 'created_ms')
if marker[1] then
  return {marker[1], marker[2], 0}
end
local now = redis.call('TIME')
local created_ms = tostring(now[1]) .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
redis.call('HSET', KEYS[1], 'boot_id', ARGV[1], 'created_ms', created_ms)
return {ARGV[1], created_ms, 1}
"""


def heartbeat_sync(client: redis.Redis, keys: Keys, record: MemberRecord, ttl_ms: int) -> None:
    """``Members.heartbeat`` through a synchronous client (for a thread that
    beats while the event loop is busy)."""
    if ttl_ms <= 0:
        raise ValueError(f"ttl_ms: {ttl_ms} is not positive")
    with client.pipeline(transaction=True) as pipe:
        pipe.set(keys.scheduler(record.member_id), record.to_json(), px=ttl_ms)
        pipe.sadd(keys.schedulers(), record.member_id)
        pipe.execute()


class Members:
    """Scheduler membership of one cluster (``keys``) through one asyncio
    client. Redis errors propagate to the caller."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._ensure_boot = client.register_script(_ENSURE_BOOT)

    async def heartbeat(self, record: MemberRecord, ttl_ms: int) -> None:
        """Registers ``record`` (or refreshes it) for ``ttl_ms``; also after
        Redis restarted empty."""
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms: {ttl_ms} is not positive")
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.scheduler(record.member_id), record.to_json(), px=ttl_ms)
            pipe.sadd(self.keys.schedulers(), record.member_id)
            await pipe.execute()

    async def leave(self, member_id: str) -> None:
        """Removes the member's record and id (a clean shutdown)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.scheduler(member_id))
            pipe.srem(self.keys.schedulers(), member_id)
            await pipe.execute()

    async def live(self) -> list[MemberRecord]:
        """The live members by member id; ids whose record expired are removed
        from ``P:schedulers``."""
        keys = self.keys
        return await live_records(
            self.client, keys.schedulers(), keys.scheduler, MemberRecord.from_json, "member"
        )

    async def ensure_boot(self) -> BootMarker:
        """The boot marker, created (random id, Redis TIME) if absent."""
        boot_id, created_ms, created_now = await self._ensure_boot(
            keys=[self.keys.boot()], args=[uuid.uuid4().hex]
        )
        return BootMarker(text(boot_id), int(created_ms), created_now == 1)
