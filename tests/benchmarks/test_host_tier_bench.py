"""``pagedkv bench host-tier``: the host tier's prefix hits on a trace whose
distinct prefixes need 4x the GPU pool, through the service's scheduler."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedkv.bench.scheduler.cli import register_host_tier_bench
from pagedkv.bench.scheduler.host_tier import main

RESULTS = Path(__file__).parent / "results"


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_host_tier_bench(parser.add_subparsers(), "host-tier")
    return parser.parse_args(["host-tier", *argv])


def test_a_host_tier_at_least_doubles_the_hit_rate_of_a_trace_four_times_the_pool(
    tmp_path: Path,
) -> None:
    output = tmp_path / "host-tier.json"
    argv = ["--num-requests", "300", "--num-prefixes", "32", "--prefix-len", "512"]
    argv += ["--num-blocks", "257", "--host-blocks", "2048", "--output", str(output)]
    assert main(_args(argv)) == 0
    report = json.loads(output.read_text())
    assert report["prefix_blocks_over_gpu_blocks"] == 4.0
    gpu, tiered = report["runs"]
    assert gpu["host_blocks"] == 0 and gpu["offloaded_blocks"] == gpu["loaded_blocks"] == 0
    assert tiered["offloaded_blocks"] > 0 and tiered["loaded_blocks"] > 0
    assert tiered["prefix_hit_rate"] >= 2 * gpu["prefix_hit_rate"]
    assert tiered["prefill_tokens"] < gpu["prefill_tokens"]
    assert "with the host tier" in output.with_suffix(".md").read_text()


def test_the_committed_run_doubles_the_hit_rate() -> None:
    report = json.loads((RESULTS / "host-tier-cpu.json").read_text())
    assert report["prefix_blocks_over_gpu_blocks"] >= 4.0
    assert report["hit_rate_ratio"] >= 2.0
