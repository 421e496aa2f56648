"""Faults of a running cluster other than a scheduler's death, against real
processes and a private Redis: the stale-mirror race of a takeover (block
tags, not the mirror, decide what is adopted), an executor killed and
restarted on its port, an executor leaving on SIGTERM, Redis killed under
load and restarted empty, and the mirror and event streams staying bounded."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import redis

from pagedkv.cluster.keys import Keys, parse_mirror_field
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import executor_pb2, scheduler_pb2
from tests.cluster.cluster_stack import Cluster, SchedulerProcess, greedy, wait_until
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import hf_greedy
from tests.redis_server import RedisServer

KEYS = Keys()
BLOCK_SIZE = 16

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


def test_an_executor_that_leaves_on_sigterm_is_dropped_and_its_keys_deleted(
    model_dir: Path, redis_url: str, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    with Cluster(model_dir, redis_url) as cluster:
        scheduler = cluster.add_scheduler()
        executors = [cluster.add_executor(), cluster.add_executor()]
        both = {e.target for e in executors}
        wait_until(lambda: scheduler.owned() == both, what="both executors claimed")
        generate(scheduler, prompt(100, 2 * BLOCK_SIZE), 2)
        # The one that cached the prompt leaves.
        wait_until(lambda: any(read_mirror(client, incarnation(e)) for e in executors))
        leaving, staying = sorted(executors, key=lambda e: not read_mirror(client, incarnation(e)))
        gone = incarnation(leaving)
        assert len(incarnation_keys_exist(client, gone)) == 3

        leaving.process.send_signal(signal.SIGTERM)
        assert leaving.process.wait(timeout=30) == 0
        wait_until(
            lambda: [e.address for e in scheduler.stats().executors] == [staying.target],
            what="the executor dropped from the stats",
        )
        wait_until(lambda: [e.address for e in view(scheduler).executors] == [staying.target])
        wait_until(lambda: not incarnation_keys_exist(client, gone), what="its keys deleted")
        assert not client.exists(KEYS.lease(leaving.target))
        assert not client.exists(KEYS.executor(leaving.target))
        expected = hf_greedy(model_dir, prompt(200, 20), 4)
        assert generate(scheduler, prompt(200, 20), 4) == expected
        stats = scheduler.stats()
        assert stats.integrity.ok, stats.integrity.message
