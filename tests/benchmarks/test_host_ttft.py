"""The end-to-end first-token benchmark of the host tier, reduced: a short
prompt on the tiny model, through ``pagedkv serve`` on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.bench.scheduler.host_ttft import TIERS, main


def test_each_round_hits_the_tier_it_claims_and_the_report_is_written(tmp_path: Path) -> None:
    output = tmp_path / "host-ttft.json"
    argv = ["--prompt-len", "240", "--rounds", "1", "--host-kv-gib", "0.01"]
    argv += ["--host-idle-offload-blocks", "16"]
    assert main([*argv, "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["summary"]["hits_as_claimed"]
    (counted,) = report["rounds"]
    assert counted["recompute"]["cached"] == 0
    assert counted["host_hit"]["host_hit_tokens"] == counted["gpu_hit"]["cached"] == 224
    assert counted["host_hit"]["loaded_blocks"] == 224 // 16
    # The blocks its step evicted went to the host while the executor was
    # idle (--host-idle-offload-blocks 16): the step only loads.
    assert counted["host_hit"]["step_copies"] == [0, 224 // 16]
    assert all(report["summary"]["median_ttft_ms"][tier] > 0 for tier in TIERS)
    assert "Host hit / recompute" in output.with_suffix(".md").read_text()
    # Where the time went, per tier found in the step traces.
    spans = {"to_scheduler", "schedule_and_send", "to_executor", "executor", "back"}
    assert all(set(where) == spans for where in report["where_ms"].values())
    assert set(report["where_ms"]) <= set(TIERS)
