"""The step profile drives the live scheduler's step code to steady decoding."""

from __future__ import annotations

from pagedkv.bench.scheduler.steps import measure
from pagedkv.bench.scheduler.tier_steps import measure as measure_tiers


def test_step_profile_measures_steps_with_every_request_decoding() -> None:
    result = measure(8, prompt_len=20, num_steps=30, tokenizer=None)
    assert result["num_requests"] == 8
    assert result["num_steps_measured"] >= 25  # all but the prefill and the first decodes
    assert result["us_per_request_per_step"] > 0


def test_step_profile_runs_decode_windows_and_counts_their_steps() -> None:
    result = measure(8, prompt_len=20, num_steps=30, tokenizer=None, decode_window=4)
    assert result["decode_window"] == 4
    assert result["num_steps_measured"] >= 25  # windows, but for the prefill and the first
    assert result["us_per_request_per_step"] > 0


def test_tier_step_profile_admits_each_prompt_from_the_tier_it_names() -> None:
    # A 256-token prompt: 16 full blocks, the last one's tokens computed.
    result = measure_tiers(256, rounds=3, host_blocks=64)
    assert result["recompute"]["loads"] == 0
    assert (result["gpu_hit"]["offloads"], result["gpu_hit"]["loads"]) == (0, 0)
    # The previous round's prompt comes back from the host, all but its last
    # block, and the blocks it takes send the GPU hit's prompt there.
    assert result["host_hit"]["loads"] == 15
    assert result["host_hit"]["offloads"] > 0
