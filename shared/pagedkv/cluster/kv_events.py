"""KV events of a prefix cache, their stream encoding, and the readers of the
mirror and the stream (the router's and the tests' side).

A stream entry (``P:events:{inc}``, see ``keys``) holds one ``EventBatch``:
consecutive events of one type, group and hash size, with ``block_ids``
packed as little-endian uint32 and ``hashes`` concatenated, plus its ``seq``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

import redis.asyncio

from pagedkv.cluster.connection import text
from pagedkv.cluster.keys import Keys, parse_mirror_field


@dataclass(frozen=True, slots=True)
class Stored:
    """Block ``block_id`` entered the prefix cache under ``block_hash``."""

    block_id: int
    block_hash: bytes
    group_id: int = 0


@dataclass(frozen=True, slots=True)
class Removed:
    """Block ``block_id`` left the prefix cache (it held ``block_hash``)."""

    block_id: int
    block_hash: bytes
    group_id: int = 0


@dataclass(frozen=True, slots=True)
class Cleared:
    """The whole prefix cache of the incarnation was dropped."""


KVEvent = Stored | Removed | Cleared
EventType = Literal["stored", "removed", "cleared"]
_EVENT_TYPES: dict[str, EventType] = {
    "stored": "stored",
    "removed": "removed",
    "cleared": "cleared",
}


class EventBatch(NamedTuple):
    """Consecutive events of one type and group: ``block_ids[i]`` holds (or
    held) ``hashes[i]``; both empty for ``cleared``."""

    type: EventType
    group_id: int
    block_ids: list[int]
    hashes: list[bytes]

    def pack(self) -> tuple[str, int, int, bytes, bytes]:
        """The entry's fields: type, group, hash_size, block_ids, hashes."""
        hash_size = len(self.hashes[0]) if self.hashes else 0
        block_ids = struct.pack(f"<{len(self.block_ids)}I", *self.block_ids)
        return self.type, self.group_id, hash_size, block_ids, b"".join(self.hashes)


def batch_events(events: Iterable[KVEvent], max_batch: int) -> list[EventBatch]:
    """``events`` in order, as batches of at most ``max_batch`` blocks (a new
    batch whenever the type, group or hash size changes)."""
    batches: list[EventBatch] = []
    for event in events:
        if isinstance(event, Cleared):
            batches.append(EventBatch("cleared", 0, [], []))
            continue
        kind: EventType = "stored" if isinstance(event, Stored) else "removed"
        last = batches[-1] if batches else None
        if (
            last is None
            or (last.type, last.group_id) != (kind, event.group_id)
            or not last.hashes
            or len(last.hashes[0]) != len(event.block_hash)
            or len(last.block_ids) >= max_batch
        ):
            last = EventBatch(kind, event.group_id, [], [])
            batches.append(last)
        last.block_ids.append(event.block_id)
        last.hashes.append(event.block_hash)
    return batches


class EventEntry(NamedTuple):
    """One stream entry as read back."""

    entry_id: str
    seq: int
    batch: EventBatch


async def read_mirror(
    client: redis.asyncio.Redis, incarnation_id: str, keys: Keys | None = None
) -> dict[tuple[bytes, int], int]:
    """The mirrored prefix cache: ``(block_hash, group_id) -> block_id``."""
    keys = keys or Keys()
    raw = await client.hgetall(keys.mirror(incarnation_id))
    return {parse_mirror_field(text(field)): int(value) for field, value in raw.items()}


async def read_events(
    client: redis.asyncio.Redis,
    incarnation_id: str,
    after_id: str = "0-0",
    *,
    count: int | None = None,
    keys: Keys | None = None,
) -> list[EventEntry]:
    """Stream entries after ``after_id`` (exclusive), oldest first. A ``seq``
    gap means entries were trimmed, a ``cleared`` batch resets the reader's
    view; either way the mirror hash is the state to reload."""
    keys = keys or Keys()
    raw = await client.xrange(keys.events(incarnation_id), min=f"({after_id}", count=count)
    entries: list[EventEntry] = []
    for entry_id, fields in raw or []:
        assert entry_id is not None and fields is not None
        entries.append(parse_entry(entry_id, fields))
    return entries


def parse_entry(entry_id: bytes | str, fields: Mapping[bytes | str, bytes | str]) -> EventEntry:
    """One stream entry (as XRANGE or XREAD return it) decoded."""
    values = {text(k): v for k, v in fields.items()}
    size = int(values["hash_size"])
    packed_ids, packed_hashes = values["block_ids"], values["hashes"]
    assert isinstance(packed_ids, bytes) and isinstance(packed_hashes, bytes)
    block_ids = list(struct.unpack(f"<{len(packed_ids) // 4}I", packed_ids))
    hashes = [packed_hashes[i : i + size] for i in range(0, len(packed_hashes), size or 1)]
    batch = EventBatch(
        _EVENT_TYPES[text(values["type"])],
        int(values["group"]),
        block_ids,
        hashes if size else [],
    )
    return EventEntry(text(entry_id), int(values["seq"]), batch)
