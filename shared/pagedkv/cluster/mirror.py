"""The prefix-cache mirror and KV event streams, written off the hot path.

``PrefixMirror`` mirrors, per executor incarnation, which block holds which
block hash (``P:mirror:{inc}``) and appends the changes to a bounded stream
(``P:events:{inc}``); see ``keys`` for the layout and ``kv_events`` for the
events and their readers. The scheduler holding an
executor's lease is the only writer of its incarnation's keys.

Contract:
- ``record`` is synchronous and never awaits: it appends to an in-memory
  buffer. A background task (``start``) flushes every ``flush_interval_s``,
  all incarnations in one MULTI/EXEC pipeline: DEL on ``cleared``, one HSET
  and one HDEL with the net change of each field, one script that appends the
  batch's stream entries (``XADD MAXLEN ~ cap``, each with the next ``seq``),
  and PEXPIRE on the incarnation's keys (so a dead cluster's keys go away).
- Consecutive events of one type and group form one stream entry (at most
  ``max_batch`` blocks). Events of untracked incarnations are ignored.
- A flush that fails is retried with the same events (re-applying them is
  harmless: the mirror's final state per field is the last event's). While
  Redis is down the buffer of an incarnation is bounded: past
  ``max_buffered_events`` it is discarded and the incarnation marked dirty.
- A dirty incarnation is resynced by the next flush that reaches Redis:
  ``cleared`` plus the full ``snapshot(incarnation_id)``, taken then (it must
  include every event recorded so far). ``track`` marks a new incarnation
  dirty (an adopted executor's mirror may lag its previous owner); a flush
  that finds the event stream gone (Redis restarted empty) marks it dirty.
- Idle incarnations have their TTL refreshed (and the stream checked) every
  ``refresh_interval_s``; otherwise an idle flush sends nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import redis
import redis.asyncio

from pagedkv.cluster.keys import Keys, mirror_field
from pagedkv.cluster.kv_events import Cleared, KVEvent, Stored, batch_events
from pagedkv.common.logging import get_logger
from pagedkv.common.tasks import cancel_and_wait

log = get_logger("pagedkv.cluster.mirror")


Snapshot = Callable[[str], list[Stored]]


# KEYS: events, seq; ARGV: maxlen, then per entry ``EventBatch.pack()``: type,
# group, hash_size, block_ids, hashes. Appends the entries with consecutive seqs; the last seq.
_APPEND = """
local seq = 0
for i = 2, #ARGV, 5 do
  seq = redis.call('INCR', KEYS[2])
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'seq', seq, 'type', ARGV[i],
    'group', ARGV[i + 1], 'hash_size', ARGV[i + 2], 'block_ids', ARGV[i + 3],
    'hashes', ARGV[i + 4])
end
return seq
"""


class _Flush(NamedTuple):
    incarnation_id: str
    resync: bool
    events: list[KVEvent]


class PrefixMirror:
    """Mirrors prefix caches and writes KV event streams (see the module
    docstring). Counters for the scheduler's metrics: ``num_flushes``
    (pipelines that succeeded), ``num_ops`` (commands sent), ``num_errors``
    (failed flushes), ``num_resyncs``, ``num_discarded`` (events dropped past
    the buffer cap); ``healthy`` is False from a failed flush until one succeeds."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keys: Keys | None = None,
        *,
        flush_interval_s: float = 0.05,
        ttl_ms: int = 600_000,
        stream_maxlen: int = 10_000,
        max_buffered_events: int = 100_000,
        refresh_interval_s: float = 1.0,
        max_batch: int = 512,
    ) -> None:
        self.client = client
        self.keys = keys or Keys()
        self.flush_interval_s = flush_interval_s
        self.ttl_ms = ttl_ms
        self.stream_maxlen = stream_maxlen
        self.max_buffered_events = max_buffered_events
        self.refresh_interval_s = refresh_interval_s
        self.max_batch = max_batch
        self.num_flushes = 0
        self.num_ops = 0
        self.num_errors = 0
        self.num_resyncs = 0
        self.num_discarded = 0
        self.healthy = True
        self._snapshots: dict[str, Snapshot] = {}
        self._buffers: dict[str, list[KVEvent]] = {}
        self._dirty: set[str] = set()
        self._drops: set[str] = set()
        self._next_refresh = 0.0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    # -- the owner's side (synchronous, never awaits) --------------------------

    def track(self, incarnation_id: str, snapshot: Snapshot) -> None:
        """Starts mirroring ``incarnation_id``; the next flush resyncs it from
        ``snapshot``."""
        self._snapshots[incarnation_id] = snapshot
        self._buffers.pop(incarnation_id, None)
        self._dirty.add(incarnation_id)

    def untrack(self, incarnation_id: str) -> None:
        """Stops mirroring (the lease is lost); buffered events are dropped and
        the keys left to the next owner."""
        self._snapshots.pop(incarnation_id, None)
        self._buffers.pop(incarnation_id, None)
        self._dirty.discard(incarnation_id)

    def drop(self, incarnation_id: str) -> None:
        """The incarnation ended: untracks it and deletes its keys at the next
        flush that reaches Redis."""
        self.untrack(incarnation_id)
        self._drops.add(incarnation_id)

    def resync(self, incarnation_id: str | None = None) -> None:
        """Marks one tracked incarnation (or all) for a full resync."""
        targets = [incarnation_id] if incarnation_id is not None else list(self._snapshots)
        for target in targets:
            if target in self._snapshots:
                self._buffers.pop(target, None)
                self._dirty.add(target)

    def record(self, incarnation_id: str, events: Iterable[KVEvent]) -> None:
        """Buffers ``events`` (in order) for the next flush."""
        if incarnation_id not in self._snapshots or incarnation_id in self._dirty:
            return
        buffer = self._buffers.setdefault(incarnation_id, [])
        buffer.extend(events)
        self._check_cap(incarnation_id)

    def _check_cap(self, incarnation_id: str) -> None:
        buffer = self._buffers.get(incarnation_id, [])
        if len(buffer) > self.max_buffered_events:
            self.num_discarded += len(buffer)
            del self._buffers[incarnation_id]
            self._dirty.add(incarnation_id)
            log.warning(
                "prefix mirror buffer full; it will be resynced from a snapshot",
                incarnation_id=incarnation_id,
                discarded=len(buffer),
            )

    # -- the background task ---------------------------------------------------

    def start(self) -> None:
        """Starts the flush task on the running event loop."""
        assert self._task is None, "already started"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="prefix-mirror")

    async def close(self) -> None:
        """Flushes once more (best effort) and stops the task."""
        await cancel_and_wait([self._task])
        self._task = None
        await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except Exception:  # a bug (e.g. an event that cannot be encoded)
                log.exception("prefix mirror flush failed; resyncing everything")
                self.resync()

    async def flush(self) -> bool:
        """Writes what is buffered now; True if Redis took it (or there was
        nothing to write). Never raises a Redis error."""
        async with self._lock:
            return await self._flush()

    async def _flush(self) -> bool:
        pending = bool(self._dirty or self._buffers or self._drops)
        if not self.healthy and pending:
            try:
                self.num_ops += 1
                await self.client.ping()
            except redis.RedisError:
                self.num_errors += 1
                return False
        now = time.monotonic()
        refresh = now >= self._next_refresh
        drops = set(self._drops)
        plan: list[_Flush] = []
        for incarnation_id, snapshot in list(self._snapshots.items()):
            if incarnation_id in self._dirty:
                try:
                    events: list[KVEvent] = [Cleared(), *snapshot(incarnation_id)]
                except Exception:  # a caller's bug: stays dirty, the others flush
                    log.exception("prefix mirror snapshot failed", incarnation_id=incarnation_id)
                    continue
                self._dirty.discard(incarnation_id)
                self._buffers.pop(incarnation_id, None)
                plan.append(_Flush(incarnation_id, True, events))
            elif (events := self._buffers.pop(incarnation_id, [])) or refresh:
                plan.append(_Flush(incarnation_id, False, events))
        if not drops and not plan:
            return True
        checks: dict[int, str] = {}  # pipeline index of a stream check -> incarnation
        async with self.client.pipeline(transaction=True) as pipe:
            num_ops = 0
            for incarnation_id in drops:
                pipe.delete(*self.keys.incarnation_keys(incarnation_id))
                num_ops += 1
            for item in plan:
                mirror_key, events_key, seq_key = self.keys.incarnation_keys(item.incarnation_id)
                if not item.resync:
                    checks[num_ops] = item.incarnation_id
                    pipe.pexpire(events_key, self.ttl_ms)
                    num_ops += 1
                num_ops += self._queue_writes(pipe, item.incarnation_id, item.events)
                for key in (mirror_key, events_key, seq_key):
                    pipe.pexpire(key, self.ttl_ms)
                num_ops += 3
            self.num_ops += num_ops
            try:
                results = await pipe.execute()
            except redis.RedisError as exc:
                self._failed(plan, exc)
                return False
        self._drops -= drops
        self.num_flushes += 1
        self.num_resyncs += sum(item.resync for item in plan)
        if refresh:
            self._next_refresh = now + self.refresh_interval_s
        if not self.healthy:
            self.healthy = True
            log.info("prefix mirror writes reach redis again")
        for index, incarnation_id in checks.items():
            if results[index] == 0 and incarnation_id in self._snapshots:
                log.info("prefix mirror keys were lost; resyncing", incarnation_id=incarnation_id)
                self.resync(incarnation_id)
        return True

    def _failed(self, plan: list[_Flush], exc: redis.RedisError) -> None:
        """Puts a failed flush's work back: events in front of what was
        recorded since, a resync back to dirty."""
        self.num_errors += 1
        if self.healthy:
            self.healthy = False
            log.warning("prefix mirror cannot reach redis; buffering", error=str(exc))
        for item in plan:
            incarnation_id = item.incarnation_id
            if incarnation_id not in self._snapshots or incarnation_id in self._dirty:
                continue
            if item.resync:
                self._buffers.pop(incarnation_id, None)
                self._dirty.add(incarnation_id)
            elif item.events:
                self._buffers[incarnation_id] = item.events + self._buffers.get(incarnation_id, [])
                self._check_cap(incarnation_id)

    def _queue_writes(
        self, pipe: redis.asyncio.client.Pipeline, incarnation_id: str, events: list[KVEvent]
    ) -> int:
        """Queues one incarnation's events on ``pipe``; the number of commands."""
        mirror_key, events_key, seq_key = self.keys.incarnation_keys(incarnation_id)
        num_ops = 0
        fields: dict[str, int | None] = {}  # net change per field (None: deleted)
        for event in events:
            if isinstance(event, Cleared):
                fields.clear()
                pipe.delete(mirror_key)
                num_ops += 1
            else:
                block_id = event.block_id if isinstance(event, Stored) else None
                fields[mirror_field(event.block_hash, event.group_id)] = block_id
        sets = {field: block_id for field, block_id in fields.items() if block_id is not None}
        deletes = [field for field, block_id in fields.items() if block_id is None]
        if sets:
            pipe.hset(mirror_key, mapping=sets)  # type: ignore[arg-type]
            num_ops += 1
        if deletes:
            pipe.hdel(mirror_key, *deletes)
            num_ops += 1
        batches = batch_events(events, self.max_batch)
        if batches:
            args = [self.stream_maxlen, *(arg for batch in batches for arg in batch.pack())]
            pipe.eval(_APPEND, 2, events_key, seq_key, *args)
            num_ops += 1
        return num_ops
