"""The step profile drives the live scheduler's step code to steady decoding."""

from __future__ import annotations

from pagedkv.bench.scheduler.steps import measure


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
