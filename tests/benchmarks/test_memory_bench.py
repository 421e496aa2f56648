"""``pagedkv bench memory``: a reduced run of each scenario against a real
``pagedkv serve``, checked against the bounds docs/memory.md explains."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedkv.bench.scheduler.memory.cli import register
from pagedkv.bench.scheduler.memory.live import Samples
from pagedkv.bench.scheduler.memory.run import main
from pagedkv.bench.scheduler.memory.scenarios import blocks_for, chat_lengths


def test_chat_lengths_have_their_mean_and_stay_within_the_context() -> None:
    lengths = chat_lengths(400, 1331, 4096, seed=1)
    assert lengths == chat_lengths(400, 1331, 4096, seed=1)
    assert all(32 <= n <= 4096 for n in lengths)
    assert 1250 < sum(lengths) / len(lengths) < 1340  # clipping trims the tail a little
    assert max(lengths) > 2 * 1331  # a long tail


def test_the_mean_skips_idle_samples_and_the_peak_takes_the_pools_own() -> None:
    samples = Samples(times_s=[0.0, 1.0, 3.0, 4.0], blocks_held=[0, 10, 40, 0])
    assert samples.peak_blocks() == 40
    samples.peak_blocks_held = [0, 12, 44, 40]  # the pool's peaks between reads
    assert samples.peak_blocks() == 44
    assert samples.time_weighted_mean(samples.blocks_held) == pytest.approx((10 * 2 + 40) / 3)
    assert blocks_for(16) == 1 and blocks_for(17) == 2


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(), "memory")
    return parser.parse_args(["memory", *argv])


@pytest.mark.slow
def test_a_reduced_run_against_pagedkv_serve_saves_what_the_report_says(tmp_path: Path) -> None:
    output = tmp_path / "memory-cpu.json"
    argv = ["--chat-requests", "4", "--chat-output-fraction", "0.03"]
    argv += ["--shared-requests", "8", "--system-len", "256", "--user-len", "64"]
    argv += ["--response-len", "16", "--beam-prompt-len", "512", "--beam-tokens", "16"]
    assert main(_args([*argv, "--output", str(output)])) == 0
    report = json.loads(output.read_text())
    assert output.with_suffix(".md").read_text().startswith("# KV memory")
    assert output.with_suffix(".png").stat().st_size > 0
    assert output.with_name("memory-cpu-bars.png").stat().st_size > 0
    server = report["server"]
    assert server["num_preemptions"] == 0 and server["integrity_ok"]
    assert server["kv_cache_dtype"] == "float32" and server["bytes_per_block"] > 0

    chat = report["chat"]
    # Only the last block's tail is wasted: at most 4% (the goal), and within
    # a point of the trace's ideal.
    assert chat["waste_fraction"] <= 0.04
    assert abs(chat["used_fraction"] - chat["trace_used_fraction"]) < 0.01
    assert chat["contiguous_concurrency"] == 20
    assert chat["paged_concurrency_measured"] > 2.5 * chat["contiguous_concurrency"]

    shared = report["shared"]
    cached = shared["prefix_caching"]["peak_blocks_held"]
    plain = shared["no_prefix_caching"]["peak_blocks_held"]
    # 256 / 16 + 8 x (64 + 16) / 16 = 56: never above it (plus one block a
    # request for the token being written), a little below when the first
    # request ends early.
    assert shared["stated_formula_blocks"] == 56
    assert 0.9 * 56 <= cached <= 56 + 8
    assert plain == pytest.approx(8 * blocks_for(256 + 64 + 16), abs=8)
    assert shared["saving_vs_contiguous"] > 0.95  # contiguous: 8 x 4096 / 16
    assert shared["saving_vs_no_prefix_caching"] > 0.6  # 1 - 56 / 168

    beams = report["beams"]
    copies = beams["contiguous_copies_blocks"]  # 4 x (512 + 16) / 16
    assert copies == 4 * 33 and beams["stated_formula_blocks"] == 32 + 4
    assert beams["independent"]["peak_blocks_held"] == pytest.approx(copies, abs=4)
    formula = beams["stated_formula_blocks"]
    # Parallel sampling: the formula plus, for each of the 3 forked samples,
    # its copy of the prompt's last block (copy-on-write).
    assert formula <= beams["parallel_sampling"]["peak_blocks_held"] <= formula + 3
    # Beam search: beams share what they agree on, so at most the prompt and
    # every beam's own blocks plus one copied block each.
    assert 32 < beams["beam_search"]["peak_blocks_held"] <= formula + 4
    assert beams["saving_beam_search_vs_copies"] > 0.6
    assert beams["saving_parallel_sampling_vs_copies"] > 0.6
