"""The prefix mirror and KV event streams against a real Redis: batched
writes, stored/removed reflected exactly, a bounded stream, drop, snapshot
resync after Redis restarts empty, and ``record`` while Redis is down."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis.asyncio

from pagedkv.cluster.connection import connect
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.kv_events import (
    Cleared,
    EventBatch,
    KVEvent,
    Removed,
    Stored,
    batch_events,
    read_events,
    read_mirror,
)
from pagedkv.cluster.mirror import PrefixMirror
from tests.cluster.conftest import run
from tests.redis_server import RedisServer

INC = "inc-1"


def h(i: int) -> bytes:
    """A 16-byte block hash."""
    return i.to_bytes(16, "big")


class Cache:
    """A stand-in for a scheduler's prefix cache: applies events, snapshots."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[bytes, int], int] = {}

    def apply(self, events: list[KVEvent]) -> list[KVEvent]:
        for event in events:
            if isinstance(event, Stored):
                self.blocks[(event.block_hash, event.group_id)] = event.block_id
            elif isinstance(event, Removed):
                del self.blocks[(event.block_hash, event.group_id)]
            else:
                self.blocks.clear()
        return events

    def snapshot(self, incarnation_id: str) -> list[Stored]:
        return [Stored(b, bh, g) for (bh, g), b in self.blocks.items()]


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "not reached before the deadline"
        await asyncio.sleep(0.02)


def test_record_calls_are_batched_and_the_mirror_follows_stored_and_removed(
    redis_url: str,
) -> None:
    async def main() -> None:
        client = connect(redis_url)
        cache = Cache()
        mirror = PrefixMirror(client)
        mirror.track(INC, cache.snapshot)
        assert await mirror.flush()  # the resync of a new incarnation: cleared
        mirror.start()
        for i in range(1, 201):
            mirror.record(INC, cache.apply([Stored(i, h(i))]))
            await asyncio.sleep(0)
        mirror.record(INC, cache.apply([Stored(7, h(1000), 1)]))  # group 1
        mirror.record(INC, cache.apply([Removed(i, h(i)) for i in range(1, 101)]))
        await eventually(lambda: _equal(client, cache))
        assert 1 < mirror.num_flushes < 202  # the records were batched
        assert mirror.num_errors == 0 and mirror.healthy
        assert await read_mirror(client, INC) == {
            **{(h(i), 0): i for i in range(101, 201)},
            (h(1000), 1): 7,
        }
        raw = await client.hgetall(Keys().mirror(INC))
        assert raw[f"{h(1000).hex()}:1".encode()] == b"7"
        assert raw[h(150).hex().encode()] == b"150"
        await mirror.close()

    run(main())


async def _equal(client: redis.asyncio.Redis, cache: Cache) -> bool:
    return await read_mirror(client, INC) == cache.blocks


def test_stream_entries_have_consecutive_seqs_and_carry_the_events(redis_url: str) -> None:
    async def main() -> None:
        client = connect(redis_url)
        cache = Cache()
        mirror = PrefixMirror(client)
        mirror.track(INC, cache.snapshot)
        assert await mirror.flush()  # the resync of a new incarnation: cleared
        mirror.record(INC, cache.apply([Stored(1, h(1)), Stored(2, h(2)), Stored(3, h(3), 1)]))
        mirror.record(INC, cache.apply([Removed(2, h(2))]))
        assert await mirror.flush()
        entries = await read_events(client, INC)
        assert [(e.seq, e.batch) for e in entries] == [
            (1, EventBatch("cleared", 0, [], [])),
            (2, EventBatch("stored", 0, [1, 2], [h(1), h(2)])),
            (3, EventBatch("stored", 1, [3], [h(3)])),
            (4, EventBatch("removed", 0, [2], [h(2)])),
        ]
        assert await read_events(client, INC, entries[1].entry_id) == entries[2:]
        assert await read_mirror(client, INC) == {(h(1), 0): 1, (h(3), 1): 3}

    run(main())


def test_the_stream_stays_within_its_cap_after_many_events(
    redis_url: str, redis_server: RedisServer
) -> None:
    async def main() -> None:
        client = connect(redis_url)
        cache = Cache()
        mirror = PrefixMirror(client, stream_maxlen=100, max_batch=1)
        mirror.track(INC, cache.snapshot)
        assert await mirror.flush()  # the resync of a new incarnation: cleared
        for i in range(1, 3001):
            mirror.record(INC, cache.apply([Stored(i, h(i))]))
            mirror.record(INC, cache.apply([Removed(i, h(i))]))
            if i % 500 == 0:
                assert await mirror.flush()
        node = int((await client.config_get("stream-node-max-entries"))["stream-node-max-entries"])
        # MAXLEN ~ trims whole stream nodes: at most one node past the cap
        assert await client.xlen(Keys().events(INC)) <= 100 + node
        entries = await read_events(client, INC)
        assert entries[-1].seq == 6001  # 1 cleared + 6,000 events
        assert await read_mirror(client, INC) == {}

    run(main())


def test_keys_have_a_ttl_and_drop_deletes_them(redis_url: str) -> None:
    async def main() -> None:
        client = connect(redis_url)
        cache = Cache()
        mirror = PrefixMirror(client, ttl_ms=60_000)
        mirror.track(INC, cache.snapshot)
        mirror.record(INC, cache.apply([Stored(1, h(1))]))
        mirror.track("inc-2", Cache().snapshot)
        assert await mirror.flush()
        keys = Keys().incarnation_keys(INC)
        ttls = [await client.pttl(key) for key in keys]
        assert all(0 < ttl <= 60_000 for ttl in ttls), ttls
        assert await read_mirror(client, INC) == {(h(1), 0): 1}
        mirror.drop(INC)
        mirror.record(INC, [Stored(2, h(2))])  # ignored: no longer tracked
        assert await mirror.flush()
        assert await client.exists(*keys) == 0
        assert await client.exists(*Keys().incarnation_keys("inc-2")) == 2  # no hash: empty

    run(main())


def test_a_mirror_lost_with_redis_is_resynced_from_the_snapshot(
    redis_url: str, redis_server: RedisServer
) -> None:
    async def main() -> None:
        client = connect(redis_url)
        cache = Cache()
        mirror = PrefixMirror(client, refresh_interval_s=0.1)
        mirror.track(INC, cache.snapshot)
        mirror.start()
        mirror.record(INC, cache.apply([Stored(i, h(i)) for i in range(1, 11)]))
        await eventually(lambda: _equal(client, cache))
        redis_server.restart()  # empty; the mirror is idle
        await eventually(lambda: _resynced(mirror, 2))  # track, then the lost stream
        assert await read_mirror(client, INC) == cache.blocks
        entries = await read_events(client, INC)
        assert (entries[0].seq, entries[0].batch) == (1, EventBatch("cleared", 0, [], []))
        assert sorted(entries[1].batch.block_ids) == list(range(1, 11))
        await mirror.close()

    run(main())


def test_record_while_redis_is_down_never_raises_and_resyncs_when_it_is_back(
    redis_url: str, redis_server: RedisServer
) -> None:
    async def main() -> None:
        client = connect(redis_url)
        cache = Cache()
        mirror = PrefixMirror(client, max_buffered_events=1000)
        mirror.track(INC, cache.snapshot)
        mirror.start()
        mirror.record(INC, cache.apply([Stored(i, h(i)) for i in range(1, 6)]))
        await eventually(lambda: _equal(client, cache))
        redis_server.kill()
        for i in range(6, 3006):
            mirror.record(INC, cache.apply([Stored(i, h(i))]))
            if i % 100 == 0:
                mirror.record(INC, cache.apply([Removed(i - 50, h(i - 50))]))
                await asyncio.sleep(0.01)
        await eventually(lambda: _unhealthy(mirror))
        assert mirror.num_discarded > 0  # the buffer stayed bounded
        assert sum(len(b) for b in mirror._buffers.values()) <= 1000
        redis_server.start()  # empty
        await eventually(lambda: _equal(client, cache))
        assert mirror.healthy
        entries = await read_events(client, INC)
        assert (entries[0].seq, entries[0].batch.type) == (1, "cleared")
        await mirror.close()

    run(main())


async def _resynced(mirror: PrefixMirror, num_resyncs: int) -> bool:
    return mirror.num_resyncs == num_resyncs


async def _unhealthy(mirror: PrefixMirror) -> bool:
    return not mirror.healthy


def test_a_short_outage_replays_the_buffered_events(
    redis_url: str, redis_server: RedisServer
) -> None:
    async def main() -> None:
        client = connect(redis_url)
        cache = Cache()
        mirror = PrefixMirror(client)
        mirror.track(INC, cache.snapshot)
        assert await mirror.flush()
        mirror.record(INC, cache.apply([Stored(1, h(1)), Cleared(), Stored(2, h(2))]))
        await client.client_kill_filter(_type="normal", skipme=False)  # drop connections
        await mirror.flush()  # may fail (reconnects once) or succeed
        await eventually(lambda: _flushed(mirror))
        assert await read_mirror(client, INC) == {(h(2), 0): 2}
        assert [e.batch.type for e in await read_events(client, INC)][-3:] == [
            "stored",
            "cleared",
            "stored",
        ]

    run(main())


async def _flushed(mirror: PrefixMirror) -> bool:
    return await mirror.flush() and not mirror._buffers


def test_events_are_batched_by_type_group_and_size_in_order() -> None:
    events: list[KVEvent] = [
        Stored(1, h(1)),
        Stored(2, h(2)),
        Stored(3, h(3)),
        Stored(4, h(4), 1),
        Removed(1, h(1)),
        Cleared(),
        Stored(5, b"short"),
    ]
    assert batch_events(events, max_batch=2) == [
        EventBatch("stored", 0, [1, 2], [h(1), h(2)]),
        EventBatch("stored", 0, [3], [h(3)]),
        EventBatch("stored", 1, [4], [h(4)]),
        EventBatch("removed", 0, [1], [h(1)]),
        EventBatch("cleared", 0, [], []),
        EventBatch("stored", 0, [5], [b"short"]),
    ]
    assert EventBatch("stored", 2, [1, 258], [b"ab", b"cd"]).pack() == (
        "stored",
        2,
        2,
        b"\x01\x00\x00\x00\x02\x01\x00\x00",
        b"abcd",
    )
