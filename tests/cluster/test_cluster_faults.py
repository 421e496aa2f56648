"""Faults of a running cluster other than a scheduler's death, against real
processes and a private Redis: the stale-mirror race of a takeover (block
tags, not the mirror, decide what is adopted), an executor killed and
restarted on its port, an executor leaving on SIGTERM, Redis killed under
load and restarted empty, and the mirror and event streams staying bounded."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import redis

from pagedkv.cluster.connection import connect
from pagedkv.cluster.keys import Keys, parse_mirror_field
from pagedkv.cluster.kv_events import EventEntry, read_events
from pagedkv.cluster.leases import Lease
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import executor_pb2, scheduler_pb2
from tests.cluster.cluster_stack import Cluster, SchedulerProcess, greedy, wait_until
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import hf_greedy
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow  # a cluster per fault, restarted under load

KEYS = Keys()
BLOCK_SIZE = 16
STREAM_CAP = 10_000 + 100  # the mirror's MAXLEN ~ 10,000, plus one stream node

MirrorState = dict[tuple[bytes, int], int]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("faults") / "llama"
    make_tiny_model(path, "llama", seed=11)
    return path


def prompt(seed: int, num_tokens: int) -> list[int]:
    """A prompt of byte tokens, distinct per seed."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(num_tokens)]


def generate(scheduler: SchedulerProcess, token_ids: list[int], max_tokens: int) -> list[int]:
    return [
        t
        for chunk in scheduler.stub.Generate(greedy(token_ids, max_tokens), timeout=120)
        for out in chunk.outputs
        for t in out.token_ids
    ]


def read_mirror(client: redis.Redis, incarnation_id: str) -> MirrorState:
    """``(block hash, group) -> block id`` as the mirror in Redis has it."""
    raw = client.hgetall(KEYS.mirror(incarnation_id))
    return {parse_mirror_field(field.decode()): int(value) for field, value in raw.items()}


def incarnation(executor: ExecutorProcess) -> str:
    info: executor_pb2.GetInfoResponse = executor.stub.GetInfo(executor_pb2.GetInfoRequest())
    return info.incarnation_id


def executor_num_blocks(executor: ExecutorProcess) -> int:
    info: executor_pb2.GetInfoResponse = executor.stub.GetInfo(executor_pb2.GetInfoRequest())
    return info.num_blocks


def num_tagged_blocks(executor: ExecutorProcess) -> int:
    info: executor_pb2.GetInfoResponse = executor.stub.GetInfo(executor_pb2.GetInfoRequest())
    return info.num_tagged_blocks


def test_a_takeover_adopts_the_block_tags_not_a_stale_mirror(
    model_dir: Path, redis_url: str, redis_server: RedisServer
) -> None:
    """The owner evicts a cached prompt's blocks and writes other prompts into
    them while its mirror cannot reach Redis (writes paused), then dies: the
    mirror still maps the prompt to those blocks. The adopter trusts the
    executor's tags instead, so the prompt is recomputed, not served stale."""
    client = redis_server.client()
    with Cluster(model_dir, redis_url, num_blocks=24) as cluster:  # 23 usable blocks
        first = cluster.add_scheduler()
        executor = cluster.add_executor()
        wait_until(lambda: first.owned() == {executor.target}, what="the first scheduler owns it")
        second = cluster.add_scheduler()
        inc = incarnation(executor)
        cached = prompt(0, 4 * BLOCK_SIZE)
        expected = hf_greedy(model_dir, cached, 4)
        assert generate(first, cached, 4) == expected
        wait_until(lambda: len(read_mirror(client, inc)) == 4, what="the prompt's blocks mirrored")
        stale = read_mirror(client, inc)

        # Writes stall (the mirror's flushes, lease renewals: the scheduler
        # turns degraded and keeps stepping); reads still answer.
        client.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            for seed in range(1, 9):  # 8 x 5 blocks through a pool of 23: evicts the prompt's
                other = prompt(seed, 4 * BLOCK_SIZE)
                generate(first, other, 2)
            assert num_tagged_blocks(executor) >= 4
            first.signal(signal.SIGKILL)
            first.process.wait()
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
        # The race was provoked: Redis still maps the prompt to its old blocks.
        assert read_mirror(client, inc) == stale

        wait_until(lambda: second.owned() == {executor.target}, what="the executor adopted")
        stats = second.stats()
        (adopted,) = [e for e in stats.executors if e.address == executor.target]
        tagged = num_tagged_blocks(executor)
        assert adopted.num_adopted_cached_blocks == tagged > 0
        # The adopter's mirror is resynced from what it adopted: the tags.
        wait_until(lambda: read_mirror(client, inc) != stale, what="the mirror resynced")
        fresh = read_mirror(client, inc)
        assert len(fresh) == tagged
        assert not set(stale) & set(fresh), "the evicted prompt's blocks were adopted"
        assert set(stale.values()) & set(fresh.values()), "no block of the prompt was reused"

        assert generate(second, cached, 4) == expected
        stats = second.stats()
        assert stats.integrity.ok, stats.integrity.message
        assert stats.num_internal_errors == 0


def view(scheduler: SchedulerProcess) -> scheduler_pb2.ClusterState:
    state: scheduler_pb2.ClusterState = scheduler.stats().cluster
    return state


def incarnation_keys_exist(client: redis.Redis, incarnation_id: str) -> list[str]:
    """Which of the incarnation's mirror keys exist in Redis."""
    return [k for k in KEYS.incarnation_keys(incarnation_id) if client.exists(k)]


def test_a_killed_executor_restarted_on_its_port_is_claimed_and_its_old_keys_go(
    model_dir: Path, redis_url: str, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    with Cluster(model_dir, redis_url) as cluster:
        scheduler = cluster.add_scheduler()
        executor = cluster.add_executor()
        wait_until(lambda: scheduler.owned() == {executor.target}, what="the executor claimed")
        old = incarnation(executor)
        cached = prompt(1, 3 * BLOCK_SIZE)
        expected = hf_greedy(model_dir, cached, 6)
        assert generate(scheduler, cached, 6) == expected
        wait_until(lambda: len(incarnation_keys_exist(client, old)) == 3, what="old keys written")

        executor.process.send_signal(signal.SIGKILL)
        executor.process.wait()
        port = executor.target.rsplit(":", 1)[1]
        restarted = cluster.add_executor("--port", port)
        assert restarted.target == executor.target
        new = incarnation(restarted)
        assert new != old

        def claimed() -> bool:
            stats = scheduler.stats()
            return [(e.address, e.healthy, e.incarnation_id) for e in stats.executors] == [
                (executor.target, True, new)
            ]

        wait_until(claimed, what="the new incarnation in service")
        wait_until(lambda: not incarnation_keys_exist(client, old), what="the old keys deleted")
        wait_until(
            lambda: (
                [(e.address, e.incarnation_id, e.owner_id) for e in view(scheduler).executors]
                == [(executor.target, new, scheduler.scheduler_id)]
            ),
            what="the cluster view shows the new incarnation leased here",
        )
        assert generate(scheduler, cached, 6) == expected
        wait_until(lambda: len(read_mirror(client, new)) == 3, what="the new incarnation mirrored")
        stats = scheduler.stats()
        assert stats.integrity.ok, stats.integrity.message
        assert stats.num_internal_errors == 0


def test_executors_that_leave_on_sigterm_are_dropped_and_their_keys_deleted(
    model_dir: Path, redis_url: str, redis_server: RedisServer
) -> None:
    """One leaves after its lease holder died (another member deletes its
    keys and never claims it), one while its holder serves it (the holder
    takes it out of service, releases its lease, deletes its keys)."""
    client = redis_server.client()
    with Cluster(model_dir, redis_url) as cluster:
        schedulers = [cluster.add_scheduler(), cluster.add_scheduler()]
        cluster.add_executor()
        cluster.add_executor()
        wait_until(lambda: [len(s.owned()) for s in schedulers] == [1, 1], what="one each")
        for scheduler in schedulers:  # cached blocks on both executors
            generate(scheduler, prompt(100, 2 * BLOCK_SIZE), 2)
        dead, survivor = schedulers
        by_address = {e.target: e for e in cluster.executors}
        (orphan,) = [by_address[a] for a in dead.owned()]
        (held,) = [by_address[a] for a in survivor.owned()]
        gone = {e.target: incarnation(e) for e in (orphan, held)}
        for inc in gone.values():
            wait_until(lambda i=inc: len(incarnation_keys_exist(client, i)) == 3, what="mirrored")

        # The survivor saw the orphan registered (one that never did cannot
        # know it ended: its keys would expire instead).
        wait_until(lambda: len(view(survivor).executors) == 2, what="the survivor sees both")
        dead.signal(signal.SIGKILL)
        dead.process.wait()
        orphan.process.send_signal(signal.SIGTERM)
        assert orphan.process.wait(timeout=30) == 0
        wait_until(lambda: [e.address for e in view(survivor).executors] == [held.target])
        wait_until(lambda: not incarnation_keys_exist(client, gone[orphan.target]))
        wait_until(lambda: [e.address for e in survivor.stats().executors] == [held.target])
        wait_until(lambda: not client.exists(KEYS.lease(orphan.target)), what="its lease expired")

        held.process.send_signal(signal.SIGTERM)
        assert held.process.wait(timeout=30) == 0
        wait_until(lambda: not survivor.stats().executors, what="dropped from the stats")
        wait_until(lambda: not view(survivor).executors)
        wait_until(lambda: not incarnation_keys_exist(client, gone[held.target]))
        assert not client.exists(KEYS.lease(held.target))
        assert not client.exists(KEYS.executor(held.target))
        stats = survivor.stats()
        assert stats.integrity.ok, stats.integrity.message
        assert stats.num_internal_errors == 0


class Load:
    """Threads that send greedy requests (prompts cycled) to their scheduler
    until stopped; ``outputs`` holds (prompt index, tokens), ``errors`` what
    failed."""

    def __init__(
        self, schedulers: list[SchedulerProcess], prompts: list[list[int]], max_tokens: int
    ) -> None:
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.outputs: list[tuple[int, list[int]]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(s, i), daemon=True)
            for i, s in enumerate(schedulers)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, scheduler: SchedulerProcess, offset: int) -> None:
        i = offset
        while not self._stop.is_set():
            index = i % len(self.prompts)
            try:
                self.outputs.append(
                    (index, generate(scheduler, self.prompts[index], self.max_tokens))
                )
            except Exception as exc:
                self.errors.append(exc)
            i += 1

    def wait_for(self, num_more: int) -> None:
        target = len(self.outputs) + num_more
        wait_until(lambda: len(self.outputs) >= target, what=f"{num_more} more requests done")

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def leases(client: redis.Redis, addresses: list[str]) -> dict[str, Lease]:
    found = {}
    for address in addresses:
        owner_id, epoch, inc = client.hmget(
            KEYS.lease(address), "owner_id", "epoch", "incarnation_id"
        )
        if owner_id is not None:
            found[address] = Lease(address, owner_id.decode(), int(epoch), inc.decode())
    return found


def test_redis_killed_under_load_then_restarted_empty_is_restored(
    model_dir: Path, redis_url: str, redis_server: RedisServer
) -> None:
    """While Redis is down the schedulers serve what they hold and say they
    are degraded; once it is back empty, the registry, the leases, the member
    records and the mirrors are written again within a few heartbeats, and a
    later takeover still gets an epoch above every earlier one."""
    prompts = [prompt(300 + i, 40) for i in range(4)]
    expected = [hf_greedy(model_dir, p, 8) for p in prompts]
    with Cluster(model_dir, redis_url) as cluster:
        schedulers = [cluster.add_scheduler(), cluster.add_scheduler()]
        cluster.add_executor()
        cluster.add_executor()
        addresses = sorted(e.target for e in cluster.executors)
        wait_until(cluster.each_owned_once, what="each executor in service on one scheduler")
        wait_until(lambda: [len(s.owned()) for s in schedulers] == [1, 1], what="one each")
        ids = [s.scheduler_id for s in schedulers]
        client = redis_server.client()
        epochs_before = {a: lease.epoch for a, lease in leases(client, addresses).items()}
        assert sorted(epochs_before) == addresses

        load = Load(schedulers, prompts, 8)
        try:
            load.wait_for(4)
            redis_server.kill()
            for scheduler in schedulers:
                wait_until(lambda s=scheduler: view(s).degraded, what="degraded")
                assert "unreachable" in view(scheduler).detail
            load.wait_for(8)  # serving goes on
            assert [len(s.owned()) for s in schedulers] == [1, 1]

            redis_server.start()  # empty
            client = redis_server.client()
            restarted = time.monotonic()

            def missing() -> str:
                """What is not restored yet (empty: everything is)."""
                served = {a: s.scheduler_id for s in schedulers for a in s.owned()}
                if sorted(served) != addresses:
                    return f"in service: {served}"
                if any(view(s).degraded for s in schedulers):
                    return "degraded"
                registered = sorted(m.decode() for m in client.smembers(KEYS.executors()))
                if registered != addresses or not all(
                    client.exists(KEYS.executor(a)) for a in addresses
                ):
                    return f"registry: {registered}"
                members = sorted(m.decode() for m in client.smembers(KEYS.schedulers()))
                if members != sorted(ids) or not all(client.exists(KEYS.scheduler(m)) for m in ids):
                    return f"members: {members}"
                owners = {a: lease.owner_id for a, lease in leases(client, addresses).items()}
                if owners != served:
                    return f"leases: {owners}, served: {served}"
                incarnations = {e.address: e.incarnation_id for e in view(schedulers[0]).executors}
                empty = [a for a in addresses if not read_mirror(client, incarnations.get(a, "?"))]
                return f"empty mirrors: {empty}" if empty else ""

            state = [""]
            try:
                wait_until(lambda: not (state.__setitem__(0, missing()) or state[0]), timeout=30)
            except AssertionError:
                raise AssertionError(f"not restored: {state[0]}") from None
            took = time.monotonic() - restarted
            assert took < 10, f"restored after {took:.1f} s"
            load.wait_for(4)
        finally:
            load.stop()
        assert not load.errors, load.errors[:3]
        for index, tokens in load.outputs:
            assert tokens == expected[index]

        held = leases(client, addresses)
        assert all(held[a].epoch >= epochs_before[a] for a in addresses)
        victim, survivor = schedulers
        (address,) = victim.owned()
        earlier = max(epochs_before[address], held[address].epoch)
        victim.signal(signal.SIGKILL)
        victim.process.wait()
        wait_until(
            lambda: survivor.owned() == set(addresses), what="the dead one's executor adopted"
        )
        (taken,) = [e for e in survivor.stats().executors if e.address == address]
        assert taken.epoch > earlier
        assert leases(client, [address])[address].epoch == taken.epoch
        assert generate(survivor, prompts[0], 8) == expected[0]
        stats = survivor.stats()
        assert stats.integrity.ok, stats.integrity.message
        assert stats.num_internal_errors == 0


def replay(entries: list[EventEntry]) -> MirrorState:
    """The mirror that the stream's entries describe (from its last cleared)."""
    state: MirrorState = {}
    for entry in entries:
        batch = entry.batch
        if batch.type == "cleared":
            state.clear()
        for block_id, block_hash in zip(batch.block_ids, batch.hashes, strict=True):
            if batch.type == "stored":
                state[(block_hash, batch.group_id)] = block_id
            else:
                assert state.pop((block_hash, batch.group_id)) == block_id
    return state


async def _read_events(redis_url: str, incarnation_id: str) -> list[EventEntry]:
    client = connect(redis_url)
    try:
        return await read_events(client, incarnation_id)
    finally:
        await client.aclose()


NUM_REQUESTS = 2000


def test_mirrors_and_event_streams_stay_bounded_over_many_requests(
    model_dir: Path, redis_url: str, redis_server: RedisServer
) -> None:
    """Thousands of distinct short prompts through small pools: each mirror
    holds at most its executor's usable blocks, equals the executor's tags
    once flushed and the replay of its stream; each stream stays within its cap."""
    client = redis_server.client()
    with Cluster(model_dir, redis_url, num_blocks=32) as cluster:
        scheduler = cluster.add_scheduler()
        executors = [cluster.add_executor(), cluster.add_executor()]
        wait_until(lambda: len(scheduler.owned()) == 2, what="both executors claimed")
        rng = random.Random(5)
        prompts = [prompt(1000 + i, rng.randrange(17, 48)) for i in range(NUM_REQUESTS)]
        num_threads = 8
        failures: list[BaseException] = []

        def send(part: list[list[int]]) -> None:
            try:
                for token_ids in part:
                    assert len(generate(scheduler, token_ids, 1)) == 1
            except BaseException as exc:
                failures.append(exc)

        threads = [
            threading.Thread(target=send, args=(prompts[i::num_threads],))
            for i in range(num_threads)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures[:3]

        for executor in executors:
            inc = incarnation(executor)

            def settled(i: str = inc, e: ExecutorProcess = executor) -> bool:
                """The last flush landed: the stream stopped growing, the
                mirror holds as many blocks as the executor tags."""
                length = client.xlen(KEYS.events(i))
                time.sleep(0.3)
                same = length == client.xlen(KEYS.events(i))
                return same and len(read_mirror(client, i)) == num_tagged_blocks(e)

            wait_until(settled, what="the mirror flushed")
            mirror = read_mirror(client, inc)
            assert 0 < len(mirror) <= executor_num_blocks(executor) - 1
            assert len(set(mirror.values())) == len(mirror)
            entries = asyncio.run(_read_events(redis_url, inc))
            assert len(entries) == client.xlen(KEYS.events(inc)) <= STREAM_CAP
            assert [e.seq for e in entries] == list(
                range(entries[0].seq, entries[0].seq + len(entries))
            )
            assert int(client.get(KEYS.events_seq(inc))) == entries[-1].seq
            assert any(e.batch.type == "removed" for e in entries), "nothing was evicted"
            if entries[0].batch.type == "cleared":  # nothing trimmed yet
                assert replay(entries) == mirror
        stats = scheduler.stats()
        assert stats.integrity.ok, stats.integrity.message
        assert sum(e.prefix_cache_queries for e in stats.executors) > 0
        assert stats.num_internal_errors == 0
