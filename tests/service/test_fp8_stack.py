"""fp8 KV blocks end to end: ``pagedkv serve --kv-cache-dtype fp8_e4m3`` on
the CPU, real executor and scheduler processes. Requests finish with every
block given back, streams that preempt one another included, and the
scheduler's stats show the blocks' dtype and their bytes (a quarter of the
float32 model's)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tests.executor.test_generation import PROMPTS, model_dirs
from tests.service.stack import serve
from tests.service.test_stack import assert_nothing_held, collect, greedy_request

__all__ = ["model_dirs"]

NUM_BLOCKS = 12  # 11 usable blocks of 16 tokens: the streams below preempt one another


def test_fp8_blocks_serve_requests_and_show_in_the_stats(model_dirs: dict[str, Path]) -> None:
    model = model_dirs["llama"]
    config = json.loads((model / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    extra = ("--kv-cache-dtype", "fp8_e4m3")
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
        assert executor.kv_cache_dtype == "float8_e4m3fn"
        assert executor.bytes_per_block == 2 * 16 * kv_heads * head_size * layers
