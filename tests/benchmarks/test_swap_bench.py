"""``pagedkv bench swap``: a reduced run against real ``pagedkv serve``
processes, checked for what it must show whatever the timings: requests are
preempted on the reduced pool, the host tier loads their blocks back, every
request ends with all its tokens, and loading KV back changes no greedy
output."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedkv.bench.scheduler.cli import register_swap_bench
from pagedkv.bench.scheduler.memory.scenarios import blocks_for
from pagedkv.bench.scheduler.swap import Pool, chat_batch, chat_settings, main


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_swap_bench(parser.add_subparsers(), "swap")
    return parser.parse_args(["swap", *argv])


def test_the_requests_are_the_memory_benchmarks_chat_and_the_pool_half_their_blocks() -> None:
    chat = chat_settings()
    assert chat == {
        "chat_requests": 30,
        "max_model_len": 4096,
        "chat_mean_len": 1331,
        "chat_output_fraction": 0.125,
    }
    batch = chat_batch(30, 0, chat)
    assert batch == chat_batch(30, 0, chat)
    assert all(len(prompt) + max_tokens <= 4096 for prompt, max_tokens in batch)
    needed = sum(blocks_for(len(prompt) + max_tokens) for prompt, max_tokens in batch)
    pool = Pool.sized(batch, 0.5, block_bytes=8192, host_kv_gib=None)
    assert pool.blocks_needed == needed
    assert pool.num_blocks == -(-needed // 2) + 1  # and the null block
    assert pool.host_kv_gib * 2**30 >= needed * 8192  # room for every block


@pytest.mark.slow
def test_a_reduced_run_preempts_loads_back_and_finishes_every_request(tmp_path: Path) -> None:
    output = tmp_path / "swap.json"
    argv = ["--num-requests", "12", "--pool-fraction", "0.35", "--modes", "off,always,auto"]
    assert main(_args([*argv, "--output", str(output)])) == 0
    report = json.loads(output.read_text())
    assert output.with_suffix(".md").read_text().startswith("# Swap versus recompute")
    batch = chat_batch(12, 0, chat_settings())
    runs = report["runs"]
    assert list(runs) == ["off", "always", "auto"]
    for mode, run in runs.items():
        assert run["num_finished"] == 12, mode
        assert run["output_tokens"] == sum(m for _, m in batch)
        assert run["integrity_ok"], mode
        assert run["num_preemptions"] > 0, mode
        assert run["tokens_recomputed"] >= 0, mode
        # Greedy: KV loaded back is the KV computed, so every output is off's.
        assert run["num_outputs_as_off"] == 12, mode
        # The step traces say where the steps' time went.
        assert 0 < run["device_busy_fraction"] <= 1, mode
        assert run["decode_device_s"] > 0 and run["prefill_device_s"] > 0, mode
        assert run["executor_launch_cpu_us"] > 0, mode
    off, always = runs["off"], runs["always"]
    assert off["num_host_blocks"] == off["num_offloaded_blocks"] == off["num_loaded_blocks"] == 0
    assert always["num_loaded_blocks"] > 0 and always["host_loads_chosen"] > 0
    assert always["host_recomputes_chosen"] == 0
    # What the loads bring back is not computed again.
    assert always["tokens_recomputed"] < off["tokens_recomputed"]
    # The tier takes full blocks as the GPU pool evicts them, each hash once.
    full = sum((len(p) + m - 1) // 16 for p, m in batch)
    assert 0 < always["num_offloaded_blocks"] <= full
    # auto on the CPU: a block's load costs far less than its tokens' prefill.
    assert runs["auto"]["num_loaded_blocks"] > 0
    assert report["verdict"]["best_of_always_and_off"] in ("always", "off")


def test_the_committed_cpu_run_preempted_and_its_loads_saved_recomputing() -> None:
    report = json.loads((Path(__file__).parent / "results" / "swap-cpu.json").read_text())
    runs = report["runs"]
    assert list(runs) == ["off", "never", "always", "auto"]
    num_requests = report["settings"]["num_requests"]
    for mode, run in runs.items():
        assert run["num_finished"] == run["num_outputs_as_off"] == num_requests, mode
        assert run["num_preemptions"] > 0, mode
    assert runs["never"]["num_loaded_blocks"] == runs["never"]["host_loads_chosen"] == 0
    for mode in ("always", "auto"):
        assert runs[mode]["num_loaded_blocks"] > 0, mode
        assert runs[mode]["tokens_recomputed"] < runs["off"]["tokens_recomputed"], mode
