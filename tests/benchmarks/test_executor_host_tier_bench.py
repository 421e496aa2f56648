"""``python -m pagedkv.bench.executor.host_tier``: a dry run on the CPU (the
tiny shape), with the profile of a GPU hit and a host hit."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.bench.executor.host_tier import main, stream_spans


def test_a_dry_run_times_every_tier_and_profiles_the_hits(tmp_path: Path) -> None:
    output = tmp_path / "host-tier.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--prompt-len", "64", "--repeat", "1"]
    argv += ["--num-blocks", "64", "--batch", "2", "--context", "32", "--iters", "2"]
    argv += ["--host-kv-gib", "0.01", "--load-chunks", "2", "--cuda-graphs", "none"]
    argv += ["--profile", str(tmp_path / "profile"), "--output", str(output)]
    assert main(argv) == 0
    report = json.loads(output.read_text())
    first = report["first_token"]
    assert set(first["ms"]) == {"recompute", "gpu_hit", "offload", "host_hit", "host_hit_evicting"}
    # Greedy: every way to the first token samples the same one (four a
    # round, a warm-up round and one counted, then the profile's three).
    assert first["same_first_token"] and len(first["first_tokens"]) == 4 * 2 + 3
    assert report["load_chunks"] == 2 and report["cuda_graphs"] == "none"
    assert set(report["profile"]) == {"gpu_hit", "host_hit"}
    assert (tmp_path / "profile" / "host_hit.json").exists()
    assert "evicted blocks" in output.with_suffix(".md").read_text()


def test_stream_spans_merge_each_streams_busy_intervals() -> None:
    events = [
        {"cat": "kernel", "ts": 1000.0, "dur": 500.0, "args": {"stream": 7}, "name": "a"},
        {"cat": "kernel", "ts": 1550.0, "dur": 100.0, "args": {"stream": 7}, "name": "b"},
        {"cat": "kernel", "ts": 3000.0, "dur": 1000.0, "args": {"stream": 7}, "name": "a"},
        {"cat": "gpu_memcpy", "ts": 1200.0, "dur": 2000.0, "args": {"stream": 9}, "name": "c"},
        {"cat": "cpu_op", "ts": 0.0, "dur": 9000.0, "name": "ignored"},
    ]
    spans = stream_spans(events)
    assert set(spans) == {"7", "9"}
    compute = spans["7"]
    assert compute["busy_intervals_ms"] == [[0.0, 0.65], [2.0, 3.0]]
    assert compute["busy_ms"] == 1.6 and compute["events"] == 3
    assert compute["names"] == {"a": 1.5, "b": 0.1}
    assert spans["9"]["first_ms"] == 0.2 and spans["9"]["last_ms"] == 2.2
