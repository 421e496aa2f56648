"""Quantized KV blocks end to end: ``pagedkv serve --kv-cache-dtype
fp8_e4m3`` (and ``int8``) on the CPU, real executor and scheduler
processes. Requests finish with every block given back, streams that
preempt one another included, and the scheduler's stats show the blocks'
dtype and their bytes (a quarter of the float32 model's for fp8, plus a
float16 scale per token and KV head for int8). A scheduler that takes such
an executor over reads the blocks it adopts, on the GPU and in the host
tier, with their scales (the executor's for fp8, the blocks' own for
int8)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import PROMPTS, model_dirs
from tests.service.stack import Process, serve
from tests.service.test_stack import assert_nothing_held, collect, greedy_request

__all__ = ["model_dirs"]

NUM_BLOCKS = 12  # 11 usable blocks of 16 tokens: the streams below preempt one another
# --kv-cache-dtype: (the blocks' dtype in the stats, bytes beside each value's
# byte per token and KV head: int8's float16 scale)
FORMATS = {"fp8_e4m3": ("float8_e4m3fn", 0), "int8": ("int8", 2)}


@pytest.mark.parametrize("kv", sorted(FORMATS))
def test_quantized_blocks_serve_requests_and_show_in_the_stats(
    model_dirs: dict[str, Path], kv: str
) -> None:
    model = model_dirs["llama"]
    config = json.loads((model / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    extra = ("--kv-cache-dtype", kv)
    with serve(model, num_blocks=NUM_BLOCKS, extra=extra) as process:
        results: dict[int, dict[int, list[int]]] = {}

        def run(i: int) -> None:
            results[i], _ = collect(process.stub, greedy_request(PROMPTS[i % len(PROMPTS)], 40))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(results) == list(range(6))
        assert all(len(tokens[0]) == 40 for tokens in results.values())
        stats = assert_nothing_held(process.stub)
        assert stats.num_preemptions > 0
        executor = stats.executors[0]
        dtype, scale_bytes = FORMATS[kv]
        assert executor.kv_cache_dtype == dtype
        assert executor.bytes_per_block == 2 * 16 * kv_heads * (head_size + scale_bytes) * layers


@pytest.mark.parametrize("kv", sorted(FORMATS))
def test_a_scheduler_taking_a_quantized_executor_over_reads_its_blocks_with_their_scales(
    model_dirs: dict[str, Path], kv: str
) -> None:
    """The scales belong to the executor (fp8) or to the blocks (int8): a
    scheduler that takes it over (its cache kept) hits the blocks the first
    scheduler left, on the GPU pool and in the host tier, and its requests
    sample what they did when those blocks were computed."""
    model = model_dirs["llama"]
    prompt = PROMPTS[2]  # 61 tokens: three full blocks
    churn = [(7 * i) % 250 + 1 for i in range(150)]  # with 8 outputs it takes all 11 blocks
    extra = ("--kv-cache-dtype", kv, "--host-kv-gib", "0.01")
    with ExecutorProcess(model, num_blocks=NUM_BLOCKS, extra_args=extra) as executor:
        args = ["scheduler", "--executor", executor.target, "--port", "0", "--model", str(model)]
        with Process(args) as first:
            expected, _ = collect(first.stub, greedy_request(prompt, 8))
            expected_churn, _ = collect(first.stub, greedy_request(churn, 8))
            stats = assert_nothing_held(first.stub).executors[0]
            assert stats.num_cached_host_blocks >= 3
        with Process(args) as second:  # takes the executor over, its cache kept
            for request, before in ((prompt, expected), (churn, expected_churn)):
                tokens, chunks = collect(second.stub, greedy_request(request, 8))
                assert tokens[0] == before[0]
                assert chunks[-1].usage.cached_prompt_tokens >= 16
            stats = assert_nothing_held(second.stub).executors[0]
            assert stats.kv_cache_dtype == FORMATS[kv][0]
            assert stats.num_adopted_cached_blocks > 0  # the churn's, on the GPU pool
            # The prompt's first block on the GPU pool, the next two from the host tier.
            assert stats.prefix_cache_hits - stats.prefix_cache_host_hits >= 16
            assert stats.prefix_cache_host_hits >= 32
