"""The host tier end to end: ``pagedkv serve --host-kv-gib`` on the CPU,
real executor and scheduler processes, against Hugging Face ``generate``.

A prefix evicted from the executor's small GPU pool is offloaded to its host
blocks and loaded back for the next request that shares it; streams that
preempt one another come back through the host tier; a model whose layout
the scheduler's tier does not serve runs as before on an executor that has
host memory; a scheduler that takes the executor over finds the prefixes
its host tier holds."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from pagedkv.v1 import scheduler_pb2
from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import PROMPTS, hf_greedy, model_dirs
from tests.service.stack import Process, serve
from tests.service.test_stack import assert_nothing_held, collect, greedy_request

__all__ = ["model_dirs"]

NUM_BLOCKS = 12  # 11 usable blocks of 16 tokens: a few requests' worth
HOST = ("--host-kv-gib", "0.01")
IDLE_OFFLOADS = ("--host-idle-offload-blocks", "11")  # the whole pool


def churn_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]):
    extra = (*HOST, *IDLE_OFFLOADS)
    with serve(model_dirs["llama"], num_blocks=NUM_BLOCKS, extra=extra) as process:
        yield process


def test_an_idle_executor_copies_its_next_blocks_out_before_anything_evicts_them(stack) -> None:
    """(First in this module: the stack's pool holds nothing cached yet.)
    With nothing else to do, the executor is sent a step that offloads the
    cached blocks its pool hands out next (``--host-idle-offload-blocks``,
    on for this module's stack), so a later eviction of them copies nothing."""
    prompt = churn_prompts(1, 69, seed=5)[0]  # with 4 outputs: 72 tokens, 4 full blocks
    collect(stack.stub, greedy_request(prompt, 4))  # 5 of the 11 blocks: nothing is evicted
    deadline = time.monotonic() + 30
    while True:
        stats = assert_nothing_held(stack.stub).executors[0]
        if stats.num_offloaded_blocks >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert stats.num_offloaded_blocks == stats.num_cached_host_blocks == 4


def test_an_evicted_prefix_comes_back_from_the_host_tier(stack, model_dirs) -> None:
    prompt = PROMPTS[2]  # 61 tokens: three full blocks
    expected = hf_greedy(model_dirs["llama"], prompt, 8)
    tokens, _ = collect(stack.stub, greedy_request(prompt, 8))
    assert tokens[0] == expected
    for other in churn_prompts(4, 64, seed=1):  # each needs 5 of the 11 blocks
        collect(stack.stub, greedy_request(other, 8))
    before = assert_nothing_held(stack.stub).executors[0]
    assert before.num_host_blocks > 0 and before.num_offloaded_blocks >= 3
    tokens, chunks = collect(stack.stub, greedy_request(prompt, 8))
    assert tokens[0] == expected
    assert chunks[-1].usage.cached_prompt_tokens >= 48
    after = assert_nothing_held(stack.stub).executors[0]
    assert after.prefix_cache_host_hits - before.prefix_cache_host_hits >= 48
    assert after.num_loaded_blocks - before.num_loaded_blocks >= 3
    # The choice and its inputs: the executor's measured costs say load.
    assert after.host_loads_chosen >= 1 and after.host_recomputes_chosen == 0
    assert after.prefill_seconds_per_token > 0 and after.host_load_seconds_per_block > 0
    # Bytes moved (blocks times the executor's bytes per block) and copy time.
    per_block = after.offloaded_bytes // after.num_offloaded_blocks
    assert per_block > 0 and after.offloaded_bytes == after.num_offloaded_blocks * per_block
    assert after.loaded_bytes == after.num_loaded_blocks * per_block
    assert after.offload_copy_seconds > 0 and after.load_copy_seconds > 0


def test_streams_that_preempt_one_another_finish_as_hugging_face_does(stack, model_dirs) -> None:
    prompts = churn_prompts(6, 40, seed=2)
    expected = [hf_greedy(model_dirs["llama"], prompt, 24) for prompt in prompts]
    results: list[list[int] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        tokens, _ = collect(stack.stub, greedy_request(prompts[i], 24))
        results[i] = tokens[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected
    assert_nothing_held(stack.stub)


def test_a_layout_the_tier_does_not_serve_ignores_the_host_memory(model_dirs) -> None:
    """Mistral's tiny model has a sliding window: the scheduler keeps no host
    tier for it (and sends no copies) though the executor has host blocks."""
    prompt = PROMPTS[0]
    with serve(model_dirs["mistral"], num_blocks=NUM_BLOCKS, extra=HOST) as process:
        tokens, _ = collect(process.stub, greedy_request(prompt, 8))
        assert tokens[0] == hf_greedy(model_dirs["mistral"], prompt, 8)
        stats = assert_nothing_held(process.stub).executors[0]
        assert stats.num_host_blocks == 0 and stats.num_offloaded_blocks == 0


def test_a_scheduler_taking_the_executor_over_finds_its_host_tier(model_dirs) -> None:
    model = model_dirs["llama"]
    prompt = PROMPTS[2]
    with ExecutorProcess(model, num_blocks=NUM_BLOCKS, extra_args=HOST) as executor:
        args = ["scheduler", "--executor", executor.target, "--port", "0", "--model", str(model)]
        with Process(args) as first:
            collect(first.stub, greedy_request(prompt, 8))
            for other in churn_prompts(4, 64, seed=3):  # the prompt's blocks go to the host
                collect(first.stub, greedy_request(other, 8))
            assert assert_nothing_held(first.stub).executors[0].num_cached_host_blocks >= 3
        with Process(args) as second:  # takes the executor over, its cache kept
            tokens, chunks = collect(second.stub, greedy_request(prompt, 8))
            assert tokens[0] == hf_greedy(model, prompt, 8)
            assert chunks[-1].usage.cached_prompt_tokens >= 48
            stats = assert_nothing_held(second.stub).executors[0]
            assert stats.prefix_cache_host_hits >= 48 and stats.num_loaded_blocks >= 3


def test_a_beam_search_swapped_out_mid_search_ends_as_a_reference_search(stack, model_dirs) -> None:
    """A beam search runs; two streams of higher priority join it on the
    small pool with a host tier. As they grow, blocks run short and the
    search, the least important, is preempted mid-search (the streams alone
    fit, so nothing else is); once the streams end it comes back, its
    blocks loaded from the host tier, and ends with the reference search's
    beams, the streams with Hugging Face's tokens."""
    from tests.service.test_stack import reference_beam_search

    before = assert_nothing_held(stack.stub)
    request = greedy_request(PROMPTS[2], 40, priority=1)  # 61 + 40 tokens: 11 blocks for two beams
    request.sampling.beam_width = 2
    search = stack.stub.Generate(request, timeout=600)  # its beams come at its end
    while not stack.stub.GetStats(scheduler_pb2.GetStatsRequest()).num_running:
        time.sleep(0.001)  # until the search runs
    others = churn_prompts(2, 32, seed=4)  # 32 + 40 tokens: 5 blocks each, 10 of the 11
    results: dict[int, list[int]] = {}

    def stream(i: int) -> None:
        tokens, _ = collect(stack.stub, greedy_request(others[i], 40))
        results[i] = tokens[0]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    chunks = list(search)
    for thread in threads:
        thread.join()
    for i, prompt in enumerate(others):
        assert results[i] == hf_greedy(model_dirs["llama"], prompt, 40)
    expected = reference_beam_search(model_dirs["llama"], PROMPTS[2], 2, 40)
    assert [list(beam.token_ids) for beam in chunks[-1].beams] == [out for _, out in expected]
    after = assert_nothing_held(stack.stub)
    assert after.num_preemptions > before.num_preemptions
    loaded = after.executors[0].num_loaded_blocks - before.executors[0].num_loaded_blocks
    assert loaded > 0
