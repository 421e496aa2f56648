"""Offloads ahead of eviction: an executor with nothing to do gets a step
with no entries that copies the cached blocks its pool hands out next to
the host tier, so that the admission that evicts them later copies nothing
out (``ExecutorScheduler.idle_step``, ``KVCacheManager.offload_ahead``)."""

from __future__ import annotations

import random

from pagedkv.bench.scheduler.executor_sim import (
    answers,
    apply_answers,
    executor_info,
    generation,
    simulated_scheduler,
)
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.sequence import Generation
from pagedkv.v1 import common_pb2

BLOCK_SIZE = 16


def scheduler(num_blocks: int, num_host_blocks: int, depth: int = 32) -> ExecutorScheduler:
    """Offloads ahead ``depth`` blocks deep (0: off, as by default)."""
    info = executor_info(num_blocks, 8, max_model_len=512)
    info.num_host_blocks = num_host_blocks
    return ExecutorScheduler(
        "bench",
        info,
        common_pb2.Owner(owner_id="bench", epoch=1),
        max_num_seqs=8,
        max_num_batched_tokens=info.max_num_batched_tokens,
        host_idle_offload_blocks=depth,
    )


def serve(s: ExecutorScheduler, key: int, prompt: list[int]) -> Generation:
    """One request of one output token, stepped until done."""
    gen = generation(s, key, prompt, 1)
    s.add(gen.sequences[0])
    token = 0
    while s.running or s.waiting:
        step = s.schedule()
        assert step is not None
        apply_answers(s, answers(step, token))
        token += 1
    return gen


def prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(3, 32_000) for _ in range(num_tokens)]


def test_an_idle_step_offloads_the_pool_s_next_blocks_and_their_eviction_copies_nothing() -> None:
    rng = random.Random(0)
    s = scheduler(num_blocks=10, num_host_blocks=64)  # 9 usable blocks
    first = prompt(rng, 8 * BLOCK_SIZE + 3)  # 8 full blocks, cached once computed, and 3 tokens
    serve(s, 1, first)
    head = [b for b in s.kv.pool.free_block_queue if b.block_hash is not None]
    assert len(head) == 8
    idle = s.idle_step()
    assert idle is not None
    message = idle.request
    # No entries: only the copies out, of the cached blocks in the order the
    # pool hands them out.
    assert not message.new_requests and not message.rows and not idle.sampled
    assert list(message.offload_block_ids) == [b.block_id for b in head]
    assert len(set(message.offload_host_block_ids)) == 8
    apply_answers(s, answers(idle, 0))
    assert s.idle_step() is None  # nothing left to offload
    assert s.kv.check_integrity().ok
    # A prompt that needs every block evicts them: its step copies nothing out.
    gen = generation(s, 2, prompt(rng, 9 * BLOCK_SIZE), 1)
    s.add(gen.sequences[0])
    step = s.schedule()
    assert step is not None
    assert not step.request.offload_block_ids and not step.request.load_block_ids
    apply_answers(s, answers(step, 1))
    # The first prompt comes back from the host as if offloaded at eviction.
    again = serve(s, 3, first)
    assert again.num_cached_prompt_tokens == 8 * BLOCK_SIZE
    host = s.kv.host
    assert host is not None
    assert host.stats.num_loaded == 8
    assert s.kv.check_integrity().ok


def test_idle_offloads_go_only_as_deep_as_asked_and_never_with_work_to_do() -> None:
    rng = random.Random(1)
    s = scheduler(num_blocks=10, num_host_blocks=64, depth=3)
    serve(s, 1, prompt(rng, 8 * BLOCK_SIZE + 3))
    head = list(s.kv.pool.free_block_queue)[:3]
    idle = s.idle_step()
    assert idle is not None
    # Only cached blocks among the first three count (uncached ones cost no copy).
    expected = [b.block_id for b in head if b.block_hash is not None]
    assert len(expected) == 2  # the partial last block, freed first, was never cached
    assert list(idle.request.offload_block_ids) == expected
    apply_answers(s, answers(idle, 0))
    # With a request waiting, or being given up, there is no idle step.
    gen = generation(s, 2, prompt(rng, 2 * BLOCK_SIZE), 4)
    s.add(gen.sequences[0])
    assert s.idle_step() is None
    s.draining = True
    assert s.idle_step() is None


def test_no_idle_step_when_off_or_without_a_host_tier() -> None:
    rng = random.Random(2)
    for s in (
        scheduler(num_blocks=20, num_host_blocks=64, depth=0),
        scheduler(num_blocks=20, num_host_blocks=0),
    ):
        serve(s, 1, prompt(rng, 8 * BLOCK_SIZE))
        assert s.idle_step() is None


def test_off_by_default() -> None:
    info = executor_info(20, 8)
    info.num_host_blocks = 64
    assert simulated_scheduler(info).host_idle_offload_blocks == 0
