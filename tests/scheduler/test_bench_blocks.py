"""`pagedkv bench blocks` runs end to end and leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _bench(tmp_path: Path, *args: str) -> dict:  # type: ignore[type-arg]
    output = tmp_path / "blocks.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.common.cli",
            "bench",
            "blocks",
            *args,
            "--output",
            str(output),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(output.read_text())  # type: ignore[no-any-return]


def test_small_trace_finishes_every_request_with_no_leak(tmp_path: Path) -> None:
    results = _bench(tmp_path, "--num-requests", "300", "--repeat", "1")
    trace = results["trace"]
    assert trace["num_finished"] == 300
    assert trace["leaked_blocks"] == 0
    assert trace["integrity_ok"]
    assert trace["prefix_hit_rate"] > 0  # shared system prompts hit
    assert results["machine"]["cores"] >= 1
    assert {
        "hash_2048_tokens_us",
        "lookup_2048_tokens_1024_cached_us",
        "trace_runs_calibration_ns_per_loop_iteration",
    } <= results.keys()
    report = (tmp_path / "blocks.md").read_text()
    assert "| leaked blocks at the end | 0 | 0 |" in report


def test_small_pool_preempts_and_still_finishes_everything(tmp_path: Path) -> None:
    results = _bench(tmp_path, "--num-requests", "300", "--num-blocks", "400", "--repeat", "2")
    trace = results["trace"]
    assert trace["num_preemptions"] > 0
    assert trace["num_finished"] == 300
    assert trace["leaked_blocks"] == 0
    assert trace["integrity_ok"]
