"""The executor registry: who serves what, kept alive by heartbeats.

An executor writes its ``ExecutorRecord`` under ``P:executor:{addr}`` with a
TTL and adds the address to ``P:executors``; a heartbeat rewrites both every
TTL/3, so a killed executor disappears within the TTL and a Redis that
restarted empty is repopulated by the next heartbeat. A clean shutdown
deletes the record, but only while it still holds this incarnation (a newer
executor on the same address is never unregistered by an older one).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass

import redis
import redis.asyncio

from pagedkv.cluster.connection import live_records
from pagedkv.cluster.keys import Keys
from pagedkv.common.logging import get_logger

log = get_logger("pagedkv.cluster.registry")

DEFAULT_TTL_MS = 3000


@dataclass(frozen=True)
class ExecutorRecord:
    """What a scheduler needs to know of an executor before it connects."""

    address: str  # HOST:PORT its Executor API is reached at
    incarnation_id: str  # new each time the executor process starts
    model_id: str
    block_size: int
    num_blocks: int  # the null block included
    bytes_per_block: int
    max_num_rows: int
    max_model_len: int
    registered_at_ms: int  # the executor's clock when this incarnation registered

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ExecutorRecord:
        """ValueError when ``text`` is not a record (missing or mistyped field)."""
        try:
            data = json.loads(text)
            record = cls(**data)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not an executor record: {exc}") from None
        for name, value in asdict(record).items():
            expected = str if name in ("address", "incarnation_id", "model_id") else int
            if type(value) is not expected:
                raise ValueError(f"not an executor record: {name}: {value!r}")
        return record


# KEYS: record, set; ARGV: json, ttl_ms, incarnation_id, address. Refreshes the
# record unless it holds another incarnation; 1 if it did.
_HEARTBEAT = """
local current = redis.call('GET', KEYS[1])
if current and cjson.decode(current)['incarnation_id'] ~= ARGV[3] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""

# KEYS: record, set; ARGV: incarnation_id, address. Deletes the record if it
# holds this incarnation (1), drops the address from the set unless another
# incarnation holds it (0 if the record was absent, -1 if another's).
_UNREGISTER = """
local current = redis.call('GET', KEYS[1])
if current and cjson.decode(current)['incarnation_id'] ~= ARGV[1] then
  return -1
end
redis.call('SREM', KEYS[2], ARGV[2])
if current then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class ExecutorRegistration:
    """Keeps one executor registered from a daemon thread.

    ``start()`` writes the record (replacing any older incarnation's) and
    starts heartbeats every ``ttl_ms / 3``; a heartbeat refreshes the record
    unless another incarnation took the address. Nothing here raises into the
    executor: while Redis is down, each beat fails quietly (one warning per
    outage) and the first beat that succeeds registers again. ``close()``
    stops the thread and unregisters this incarnation (compare-and-delete).
    ``healthy`` says whether the last beat reached Redis.
    """

    def __init__(
        self,
        client: redis.Redis,
        record: ExecutorRecord,
        *,
        keys: Keys | None = None,
        ttl_ms: int = DEFAULT_TTL_MS,
    ) -> None:
        if ttl_ms < 3:
            raise ValueError(f"ttl_ms: {ttl_ms} < 3")
        self.client = client
        self.record = record
        self.keys = keys or Keys()
        self.ttl_ms = ttl_ms
        self.healthy = False
        self.num_beats = 0  # beats that reached Redis
        self._json = record.to_json()
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._unregister = client.register_script(_UNREGISTER)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-registration", daemon=True)
        self._down_since: float | None = None
        self._replaced = False

    def start(self) -> None:
        """Registers (or keeps trying to, from the thread) and starts beating."""
        self._thread.start()

    def _run(self) -> None:
        first = True
        while True:
            self._beat(force=first)
            first = first and not self.healthy
            if self._stop.wait(self.ttl_ms / 3000):
                return

    def _beat(self, *, force: bool) -> None:
        record_key, set_key = self.keys.executor(self.record.address), self.keys.executors()
        try:
            if force:
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.set(record_key, self._json, px=self.ttl_ms)
                    pipe.sadd(set_key, self.record.address)
                    pipe.execute()
                refreshed = True
            else:
                refreshed = bool(
                    self._heartbeat(
                        keys=[record_key, set_key],
                        args=[
                            self._json,
                            self.ttl_ms,
                            self.record.incarnation_id,
                            self.record.address,
                        ],
                    )
                )
        except redis.RedisError as exc:
            self.healthy = False
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning(
                    "redis unreachable; executor registration keeps retrying",
                    address=self.record.address,
                    error=str(exc),
                )
            return
        self.healthy = True
        self.num_beats += 1
        if self._down_since is not None:
            log.info(
                "executor registered again after a redis outage",
                address=self.record.address,
                outage_s=round(time.monotonic() - self._down_since, 1),
            )
            self._down_since = None
        elif self.num_beats == 1:
            log.info(
                "executor registered",
                address=self.record.address,
                incarnation_id=self.record.incarnation_id,
            )
        if not refreshed and not self._replaced:
            self._replaced = True
            log.warning(
                "another executor incarnation registered this address; not overwriting it",
                address=self.record.address,
            )

    def close(self) -> bool:
        """Stops heartbeats and unregisters this incarnation; True if its
        record was deleted (False when Redis is down, the record had expired,
        or another incarnation holds the address). Never raises."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            removed = self._unregister(
                keys=[self.keys.executor(self.record.address), self.keys.executors()],
                args=[self.record.incarnation_id, self.record.address],
            )
        except redis.RedisError as exc:
            log.warning("could not unregister the executor", error=str(exc))
            return False
        log.info("executor unregistered", address=self.record.address, removed=removed == 1)
        return bool(removed == 1)


async def list_executors(
    client: redis.asyncio.Redis, keys: Keys | None = None
) -> list[ExecutorRecord]:
    """The registered executors whose record is alive, by address. Addresses
    whose record expired are removed from ``P:executors`` (a live executor
    adds its address back at its next heartbeat); unreadable records are
    logged and left out."""
    keys = keys or Keys()
    return await live_records(
        client, keys.executors(), keys.executor, ExecutorRecord.from_json, "executor"
    )
