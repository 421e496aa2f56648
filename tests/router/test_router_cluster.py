"""The router in front of a live cluster (issue 12, real processes: a private
redis-server, 4 CPU executors, 2 schedulers, 1 router): a cached prefix is
served on the executor that holds it, a hot prefix spreads, and placement
stays right after a router restart, a trimmed event stream and a scheduler's
SIGKILL. Every greedy output equals Hugging Face's."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.client import AsyncClient
from pagedkv.cluster.connection import connect_sync
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import scheduler_pb2
from tests.cluster.cluster_stack import Cluster, SchedulerProcess, greedy, wait_until
from tests.router.router_stack import (
    PREFIX_TOKENS,
    Ran,
    References,
    RouterProcess,
    generate,
    make_prefix,
    with_suffix,
)

pytestmark = pytest.mark.slow  # routed clusters, restarted and killed under load

NUM_EXECUTORS = 4
PREFIX_BLOCKS = PREFIX_TOKENS // 16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("router") / "llama"
    make_tiny_model(path, "llama", seed=5)
    return path


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> References:
    return References(model_dir)


@pytest.fixture
def cluster(model_dir: Path, redis_url: str) -> Iterator[Cluster]:
    with Cluster(model_dir, redis_url, num_blocks=512) as cluster:
        for _ in range(NUM_EXECUTORS):
            cluster.add_executor()
        for _ in range(2):
            cluster.add_scheduler()
        # Balanced, not only owned: a placement read while rebalancing still
        # moves an executor can name its former holder (hint not_held).
        wait_until(cluster.balanced, what="every executor in service once, shares held")
        yield cluster


def start_router(cluster: Cluster, num_blocks: int = 0, debug_json: bool = False) -> RouterProcess:
    router = RouterProcess(cluster.redis_url, debug_json=debug_json)
    wait_until(lambda: router.sees(NUM_EXECUTORS, num_blocks), what="the router sees the cluster")
    return router


def run_one(router: RouterProcess, prompt: list[int], hf: References) -> Ran:
    """Runs ``prompt`` through the router; checks its output against HF."""

    async def call() -> Ran:
        async with AsyncClient(router.target, timeout=120) as client:
            return await generate(client, prompt, MAX_TOKENS)

    ran = asyncio.run(call())
    assert ran.token_ids == hf(prompt, MAX_TOKENS)
    return ran


def json_records(router: RouterProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in router.stderr().splitlines() if line.startswith("{")]


def direct(scheduler: SchedulerProcess, prompt: list[int]) -> str:
    """Runs ``prompt`` on ``scheduler`` itself; the executor it placed it on."""
    chunks = list(scheduler.stub.Generate(greedy(prompt, MAX_TOKENS), timeout=120))
    assert chunks[-1].HasField("usage")
    return str(chunks[0].placement.executor)


def test_a_cached_prefix_is_served_where_it_is_cached_and_a_hot_one_spreads(
    cluster: Cluster, hf: References
) -> None:
    with start_router(cluster) as router:
        prefix = make_prefix(1)
        first = run_one(router, with_suffix(prefix, 0), hf)
        assert first.cached_tokens == 0 and first.hint == "honoured"
        wait_until(lambda: router.sees(NUM_EXECUTORS, PREFIX_BLOCKS), what="prefix indexed")
        for seed in range(1, 5):
            ran = run_one(router, with_suffix(prefix, seed), hf)
            assert (ran.executor, ran.hint) == (first.executor, "honoured")
            assert ran.cached_tokens >= PREFIX_TOKENS
        with start_router(cluster, PREFIX_BLOCKS, debug_json=True) as second:
            ran = run_one(second, with_suffix(prefix, 5), hf)  # routers side by side agree
            assert (ran.executor, ran.hint) == (first.executor, "honoured")
            (decision,) = [r for r in json_records(second) if r["event"] == "routed"]
            assert decision["decision"] == "cache_hit" and decision["policy"] == "kv"
            best = decision["candidates"][0]
            assert best["executor"] == first.executor
            assert best["cached_blocks"] == PREFIX_BLOCKS and "score" in best
        stats = router.stats()
        by_address = {e.address: e for e in stats.executors}
        assert by_address[first.executor].prefix_cache_hits >= 4 * PREFIX_TOKENS
        assert stats.integrity.ok, stats.integrity.message
        assert router.metric("pagedkv_router_decisions_total", 'kind="cache_hit"') >= 4
        assert router.metric("pagedkv_router_placement_hints_total", 'outcome="honoured"') >= 5

        async def burst() -> list[list[int]]:
            async with AsyncClient(router.target, timeout=300) as client:
                prompts = [with_suffix(prefix, 100 + i) for i in range(64)]
                runs = await asyncio.gather(*(generate(client, p, 4) for p in prompts))
            executors = {r.executor for r in runs}
            assert len(executors) > 1, executors  # not all piled onto the holder
            assert all(r.hint == "honoured" for r in runs)
            return [r.token_ids for r in runs[:8]]

        outputs = asyncio.run(burst())
        for i, tokens in enumerate(outputs):
            assert tokens == hf(with_suffix(prefix, 100 + i), 4)
        check_the_api_edges(router, cluster)


def check_the_api_edges(router: RouterProcess, cluster: Cluster) -> None:
    """Health, bad requests and Abort through the router; nothing is left held."""
    health = health_pb2_grpc.HealthStub(router.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as missing:
        list(router.stub.Generate(scheduler_pb2.GenerateRequest(), timeout=30))
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in (missing.value.details() or "")
    bad = greedy([1, 2, 3], 4)
    bad.sampling.top_p = 1.5
    with pytest.raises(grpc.RpcError) as refused:
        list(router.stub.Generate(bad, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the scheduler's
    assert "sampling.top_p" in (refused.value.details() or "")
    stream = router.stub.Generate(greedy(make_prefix(7), 400, request_id="long"), timeout=120)
    first = next(stream)
    assert first.request_id == "long"
    aborted = router.stub.Abort(scheduler_pb2.AbortRequest(request_id="long"), timeout=30)
    assert aborted.aborted
    final = list(stream)[-1]
    assert final.outputs[-1].finish_reason == scheduler_pb2.FINISH_REASON_ABORT
    unknown = router.stub.Abort(scheduler_pb2.AbortRequest(request_id="none"), timeout=30)
    assert not unknown.aborted

    def nothing_held() -> bool:
        stats = router.stats()
        return stats.num_running == stats.num_waiting == 0 and all(
            e.num_free_blocks == e.num_usable_blocks for e in stats.executors if e.healthy
        )

    wait_until(nothing_held, what="every block free again")
    # The reset passes through to every scheduler: the peaks read once, then 0.
    reset = scheduler_pb2.GetStatsRequest(reset_peak_used_blocks=True)
    peaks = [e.peak_used_blocks for e in router.stub.GetStats(reset, timeout=30).executors]
    assert max(peaks) > 0  # the requests above, though every block is free now
    after = router.stub.GetStats(reset, timeout=30).executors
    assert [e.peak_used_blocks for e in after] == [0] * len(peaks)


def test_placement_survives_router_restart_trimmed_streams_and_a_scheduler_kill(
    cluster: Cluster, hf: References
) -> None:
    prefixes = [make_prefix(10 + i) for i in range(3)]
    router = start_router(cluster, debug_json=True)
    try:
        homes = [run_one(router, with_suffix(p, 0), hf).executor for p in prefixes]
        wait_until(lambda: router.sees(NUM_EXECUTORS, 3 * PREFIX_BLOCKS), what="indexed")
        router.close()

        # A new router rebuilds its index from the mirrors.
        router = start_router(cluster, 3 * PREFIX_BLOCKS, debug_json=True)
        ran = run_one(router, with_suffix(prefixes[0], 1), hf)
        assert ran.executor == homes[0] and ran.cached_tokens >= PREFIX_TOKENS

        # The router pauses while a scheduler caches a new prefix, and the
        # event streams are trimmed before it reads them (as if it lagged past
        # the cap): the next events show a seq gap and it reloads the mirror.
        router.process.send_signal(signal.SIGSTOP)
        fourth = make_prefix(13)
        scheduler = cluster.live_schedulers()[0]
        home = direct(scheduler, with_suffix(fourth, 0))
        time.sleep(0.5)  # the scheduler's mirror flushes
        redis = connect_sync(cluster.redis_url)
        for key in redis.scan_iter(match="pagedkv:events:*"):
            redis.xtrim(key, maxlen=0, approximate=False)
        assert direct(scheduler, fourth + list(range(20))) == home  # one more full block
        time.sleep(0.5)
        router.process.send_signal(signal.SIGCONT)
        wait_until(
            lambda: router.metric("pagedkv_router_index_reloads_total", 'reason="gap"') >= 1,
            what="a reload after the gap",
        )
        wait_until(lambda: router.sees(NUM_EXECUTORS, 4 * PREFIX_BLOCKS), what="reindexed")
        assert run_one(router, with_suffix(fourth, 1), hf).executor == home
        assert run_one(router, with_suffix(prefixes[1], 2), hf).executor == homes[1]

        # The scheduler holding the first prefix's executor is killed while
        # requests stream through the router: the SDK resumes them through
        # it, the survivor adopts the executor with its cache, and the
        # prefix is placed there again.
        owner_id = next(
            e.owner_id for e in router.stats().cluster.executors if e.address == homes[0]
        )
        victim = next(s for s in cluster.schedulers if s.scheduler_id == owner_id)

        async def under_kill() -> None:
            async with AsyncClient(router.target, timeout=300) as client:
                prompts = [with_suffix(prefixes[i % 3], 20 + i) for i in range(8)]
                calls = [asyncio.ensure_future(generate(client, p, 24)) for p in prompts]
                await asyncio.sleep(1.0)
                victim.signal(signal.SIGKILL)
                runs = await asyncio.gather(*calls)
            for prompt, ran in zip(prompts, runs, strict=True):
                assert ran.token_ids == hf(prompt, 24)

        asyncio.run(under_kill())
        wait_until(cluster.each_owned_once, what="the survivor adopts every executor")
        wait_until(lambda: router.sees(NUM_EXECUTORS), what="the router sees the new owner")
        # The survivor kept the adopted executor's cache, and the prefix is
        # placed where it is cached again. The index is a hint that may lag
        # the adoption (the dead scheduler's last events can name blocks
        # whose step never ran; the survivor's resync corrects them): a
        # request routed on a stale entry misses, and later ones hit.
        seeds = itertools.count(3)

        def hits_the_cache() -> bool:
            ran = run_one(router, with_suffix(prefixes[0], next(seeds)), hf)
            return ran.cached_tokens >= PREFIX_TOKENS

        wait_until(hits_the_cache, what="the first prefix placed where it is cached")
        decisions = [r for r in json_records(router) if r["event"] == "routed"]
        assert decisions[-1]["decision"] == "cache_hit"
        stats = router.stats()
        adopted = {e.address: e.num_adopted_cached_blocks for e in stats.executors if e.healthy}
        assert adopted[homes[0]] >= PREFIX_BLOCKS
        assert stats.integrity.ok, stats.integrity.message
        assert list(stats.cluster.scheduler_ids) == [
            s.scheduler_id for s in cluster.live_schedulers()
        ]
    finally:
        router.close()
