"""Following the KV event streams of every registered executor incarnation
into the router's ``PrefixIndex``.

For each incarnation the follower keeps a cursor: the last stream entry id it
applied and that entry's ``seq``. One XREAD call reads every followed stream
after its cursor (blocking up to ``block_ms`` for news), and the entries are
applied in order:

- ``stored`` / ``removed`` add and remove hashes (KV cache group 0 only; the
  router scores on the group every model has);
- ``cleared`` drops what the index holds for the incarnation (a resync's
  snapshot follows it as ``stored`` entries);
- a ``seq`` that is not the cursor's plus one means entries were trimmed
  (the stream is capped) or lost: the incarnation is reloaded from its mirror
  hash, read in one MULTI with the stream's last entry and seq, so the
  cursor continues exactly after the state the mirror showed.

``sync`` (called by the router's refresh loop) starts following new
incarnations (a reload first), forgets ended ones, and notices a stream that
went backwards (Redis restarted empty: its ``seq`` is below the cursor's),
which also forces a reload. ``lag_s`` is the newest applied entry's age: the
router's clock minus the entry id's milliseconds (Redis' clock at XADD).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio

from pagedkv.cluster.connection import text
from pagedkv.cluster.keys import Keys, parse_mirror_field
from pagedkv.cluster.kv_events import EventEntry, parse_entry
from pagedkv.common.logging import get_logger
from pagedkv.router.index import PrefixIndex

log = get_logger(__name__)

START_ID = "0-0"


@dataclass(slots=True)
class _Cursor:
    entry_id: str = START_ID
    seq: int = 0


class KVEventFollower:
    """Keeps ``index`` from the KV events of the incarnations given to
    ``sync``. Redis errors propagate to the caller (the router's loops), which
    retries; nothing is lost, since a cursor only moves after its entries
    are applied. ``on_lag(seconds)`` is called per applied entry, and
    ``on_reload(reason)`` per reload ("new", "gap", "restarted")."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        index: PrefixIndex,
        keys: Keys | None = None,
        *,
        count: int = 1000,
        block_ms: int = 100,
        on_lag: Callable[[float], None] | None = None,
        on_reload: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.index = index
        self.keys = keys or Keys()
        self.count = count
        self.block_ms = block_ms
        self.on_lag = on_lag
        self.on_reload = on_reload
        self.cursors: dict[str, _Cursor] = {}
        self.lag_s = 0.0
        self.num_entries = 0
        self.num_reloads = 0

    async def sync(self, incarnations: Iterable[str]) -> None:
        """Follows exactly ``incarnations``: new ones are loaded from their
        mirror, ended ones dropped from the index, and a stream whose seq went
        below the cursor's (Redis lost its data) is reloaded."""
        wanted = set(incarnations)
        for incarnation in [i for i in self.cursors if i not in wanted]:
            del self.cursors[incarnation]
            self.index.clear(incarnation)
        # The seqs applied before the read: ``poll`` may apply newer entries
        # while it is under way, and only a seq below what was already applied
        # means the stream went backwards.
        applied = {i: c.seq for i, c in self.cursors.items() if i in wanted}
        if applied:
            seqs = await self.client.mget([self.keys.events_seq(i) for i in applied])
            for (incarnation, seq_before), value in zip(applied.items(), seqs, strict=True):
                seq = int(value) if value is not None else 0
                if seq < seq_before and incarnation in self.cursors:
                    await self.reload(incarnation, "restarted")
        for incarnation in sorted(wanted - set(self.cursors)):
            await self.reload(incarnation, "new")

    def reset(self) -> None:
        """Forgets every cursor and index entry: the next ``sync`` reloads
        each incarnation from its mirror."""
        for incarnation in self.cursors:
            self.index.clear(incarnation)
        self.cursors.clear()

    async def reload(self, incarnation: str, reason: str) -> None:
        """Replaces the incarnation's index entries with its mirror hash and
        moves its cursor to the stream's last entry, read atomically."""
        keys = self.keys
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(keys.mirror(incarnation))
            pipe.xrevrange(keys.events(incarnation), count=1)
            pipe.get(keys.events_seq(incarnation))
            mirror, last, seq = await pipe.execute()
        hashes = []
        for field in mirror:
            block_hash, group_id = parse_mirror_field(text(field))
            if group_id == 0:
                hashes.append(block_hash)
        self.index.replace(incarnation, hashes)
        entry_id = text(last[0][0]) if last else START_ID
        self.cursors[incarnation] = _Cursor(entry_id, int(seq) if seq is not None else 0)
        self.num_reloads += 1
        if self.on_reload is not None:
            self.on_reload(reason)
        log.debug("prefix index reloaded", incarnation_id=incarnation, reason=reason,
                  num_blocks=len(hashes))  # fmt: skip

    async def poll(self) -> int:
        """Reads and applies what the followed streams gained (waits up to
        ``block_ms`` when nothing is new); the number of entries applied."""
        if not self.cursors:
            return 0
        keys = self.keys
        streams = {keys.events(i): c.entry_id for i, c in self.cursors.items()}
        replies: Any = await self.client.xread(
            streams,  # type: ignore[arg-type]
            count=self.count,
            block=self.block_ms,
        )
        by_key = {keys.events(i): i for i in self.cursors}
        applied = 0
        now_ms = time.time() * 1000
        for stream, raw_entries in replies or []:
            incarnation = by_key.get(text(stream))
            if incarnation is None:
                continue
            entries = [parse_entry(entry_id, fields) for entry_id, fields in raw_entries]
            applied += await self._apply(incarnation, entries, now_ms)
        return applied

    async def _apply(self, incarnation: str, entries: list[EventEntry], now_ms: float) -> int:
        cursor = self.cursors.get(incarnation)
        applied = 0
        for entry in entries:
            if cursor is None:
                break
            if entry.seq != cursor.seq + 1:
                log.info("kv event gap; reloading from the mirror", incarnation_id=incarnation,
                         expected_seq=cursor.seq + 1, seq=entry.seq)  # fmt: skip
                await self.reload(incarnation, "gap")
                break
            batch = entry.batch
            if batch.type == "cleared":
                self.index.clear(incarnation)
            elif batch.group_id == 0:
                if batch.type == "stored":
                    self.index.add(incarnation, batch.hashes)
                else:
                    self.index.remove(incarnation, batch.hashes)
            cursor.entry_id, cursor.seq = entry.entry_id, entry.seq
            applied += 1
            lag = max(0.0, now_ms - int(entry.entry_id.split("-")[0])) / 1000
            self.lag_s = lag
            if self.on_lag is not None:
                self.on_lag(lag)
        self.num_entries += applied
        return applied
