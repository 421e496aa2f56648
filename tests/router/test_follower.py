"""The router's KV event follower against a real Redis, written by the real
prefix mirror: it follows stored and removed events, reloads from the mirror
after a gap (a trimmed stream) and after Redis lost its data, and drops ended
incarnations."""

from __future__ import annotations

import redis.asyncio

from pagedkv.cluster.connection import connect
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.kv_events import Removed, Stored
from pagedkv.cluster.mirror import PrefixMirror
from pagedkv.router.follower import KVEventFollower
from pagedkv.router.index import PrefixIndex
from tests.cluster.conftest import run


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Cache:
    """A scheduler's cache as the mirror sees it: applied events and a snapshot."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, int] = {}

    def store(self, mirror: PrefixMirror, inc: str, ids: range) -> None:
        events = [Stored(i, h(i)) for i in ids]
        self.blocks.update((e.block_hash, e.block_id) for e in events)
        mirror.record(inc, events)

    def remove(self, mirror: PrefixMirror, inc: str, ids: range) -> None:
        events = [Removed(i, h(i)) for i in ids]
        for e in events:
            del self.blocks[e.block_hash]
        mirror.record(inc, events)

    def snapshot(self, _: str) -> list[Stored]:
        return [Stored(b, bh) for bh, b in self.blocks.items()]


async def drain(follower: KVEventFollower) -> None:
    while await follower.poll():
        pass


def test_stored_and_removed_events_reach_the_index(redis_url: str) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        mirror, cache, index = PrefixMirror(client), Cache(), PrefixIndex()
        follower = KVEventFollower(client, index, block_ms=10)
        mirror.track("a", cache.snapshot)
        cache.store(mirror, "a", range(1, 5))
        await mirror.flush()
        await follower.sync(["a"])  # loads the mirror, then follows the stream
        assert index.match([h(1), h(2), h(3), h(4)]) == {"a": 4}
        cache.store(mirror, "a", range(5, 7))
        cache.remove(mirror, "a", range(2, 3))
        await mirror.flush()
        await drain(follower)
        assert index.match([h(1), h(2)]) == {"a": 1}
        assert index.num_blocks("a") == 5
        assert follower.num_reloads == 1 and follower.lag_s >= 0.0
        await follower.sync([])  # the incarnation ended
        assert index.num_blocks() == 0 and not follower.cursors
        await client.aclose()

    run(scenario())


def test_a_trimmed_stream_is_reloaded_from_the_mirror(redis_url: str) -> None:
    async def scenario() -> None:
        client: redis.asyncio.Redis = connect(redis_url)
        mirror, cache, index = PrefixMirror(client), Cache(), PrefixIndex()
        reasons: list[str] = []
        follower = KVEventFollower(client, index, block_ms=10, on_reload=reasons.append)
        mirror.track("a", cache.snapshot)
        await mirror.flush()
        await follower.sync(["a"])
        for start in range(1, 40, 4):  # several stream entries
            cache.store(mirror, "a", range(start, start + 4))
            await mirror.flush()
        cache.remove(mirror, "a", range(1, 3))
        await mirror.flush()
        await client.xtrim(Keys().events("a"), maxlen=1, approximate=False)  # lagged past the cap
        await drain(follower)
        assert reasons == ["new", "gap"]
        assert index.num_blocks("a") == len(cache.blocks) == 38
        assert index.match([h(1)]) == {}
        cache.store(mirror, "a", range(100, 101))  # followed again after the reload
        await mirror.flush()
        await drain(follower)
        assert index.num_blocks("a") == 39
        await client.aclose()

    run(scenario())


def test_redis_losing_its_data_forces_a_reload_and_the_resync_is_followed(
    redis_url: str,
) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        mirror, cache, index = PrefixMirror(client), Cache(), PrefixIndex()
        reasons: list[str] = []
        follower = KVEventFollower(client, index, block_ms=10, on_reload=reasons.append)
        mirror.track("a", cache.snapshot)
        cache.store(mirror, "a", range(1, 9))
        await mirror.flush()
        await follower.sync(["a"])
        cache.store(mirror, "a", range(9, 11))
        await mirror.flush()
        await drain(follower)
        await client.flushall()  # Redis restarted empty
        await follower.sync(["a"])
        assert reasons == ["new", "restarted"] and index.num_blocks("a") == 0
        mirror.resync()  # what the scheduler does when it sees a new boot id
        await mirror.flush()
        await drain(follower)
        assert index.num_blocks("a") == 10
        assert index.match([h(i) for i in range(1, 11)]) == {"a": 10}
        await client.aclose()

    run(scenario())
