"""The host tier reaches the router: a scheduler's host index is mirrored in
Redis under the executor's host-tier name (``host_tier_incarnation``), and
the router's follower indexes it beside the GPU cache."""

from __future__ import annotations

from pagedkv.bench.scheduler.executor_sim import (
    answers,
    apply_answers,
    executor_info,
    generation,
    simulated_scheduler,
)
from pagedkv.cluster.connection import connect
from pagedkv.cluster.keys import host_tier_incarnation
from pagedkv.cluster.mirror import PrefixMirror
from pagedkv.router.follower import KVEventFollower
from pagedkv.router.index import PrefixIndex, prompt_block_hashes
from pagedkv.scheduler.cluster_feeds import MirroredCaches
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from tests.cluster.conftest import run

BLOCK_SIZE = 16


def tiered_scheduler() -> ExecutorScheduler:
    info = executor_info(9, 4, block_size=BLOCK_SIZE)  # 8 usable GPU blocks
    info.num_host_blocks = 32
    info.incarnation_id = "inc-a"
    return simulated_scheduler(info)


def serve(scheduler: ExecutorScheduler, prompts: list[list[int]]) -> None:
    """Runs each prompt (4 tokens out) to its end, one after another."""
    for key, prompt in enumerate(prompts, 1):
        scheduler.add(generation(scheduler, key, prompt, 4).sequences[0])
        steps = 0
        while scheduler.running or scheduler.waiting:
            step = scheduler.schedule()
            assert step is not None
            apply_answers(scheduler, answers(step, steps))
            steps += 1


def test_the_router_sees_a_prefix_the_gpu_evicted_in_the_host_tier(redis_url: str) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        mirror, index = PrefixMirror(client), PrefixIndex()
        scheduler = tiered_scheduler()
        MirroredCaches(mirror).adopted(scheduler)
        prompt = list(range(1, 1 + 4 * BLOCK_SIZE + 1))  # four full blocks
        others = [list(range(1000 * k, 1000 * k + 6 * BLOCK_SIZE)) for k in (1, 2)]
        serve(scheduler, [prompt, *others])  # the others evict the prompt's blocks
        await mirror.flush()
        follower = KVEventFollower(client, index, block_ms=10)
        host = host_tier_incarnation("inc-a")
        await follower.sync(["inc-a", host])
        hashes = prompt_block_hashes(prompt, "bench", BLOCK_SIZE)
        assert len(hashes) == 4
        depth = index.match(hashes)
        assert depth.get("inc-a", 0) == 0  # gone from the GPU
        assert depth[host] == 4  # kept on the host
        assert scheduler.kv.host is not None
        assert index.num_blocks(host) == len(scheduler.kv.host.cached())
        await client.aclose()

    run(scenario())
