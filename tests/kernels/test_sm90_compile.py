"""Every variant of the cache and attention kernels a GPU would build
compiles for sm_90 (H100, H200) on this machine too, down to ``ptxas``
(sm90_compile.py): the interpreter the other kernel tests run under
accepts code the GPU compiler may refuse. On a machine with a GPU the
kernels compile and run for real instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_reshape_and_cache_kernel",
    "_rotary_and_cache_kernel",
    "_paged_attention_kernel",
    "_prefill_kernel",
    "prefill_specialized_kernel",
    "prefill_persistent_kernel",
    "_decode_split_kernel",
    "_decode_merge_kernel",
    "_copy_blocks_kernel",
    "_dequant_blocks_kernel",
    "_block_rows_kernel",
}


def _run_module(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m ARGS`` from the repository, without the interpreter
    (kernels must be defined compiled); asserts it exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU builds and runs them for real")
def test_every_cache_kernel_variant_compiles_for_sm90() -> None:
    done = _run_module("tests.kernels.sm90_compile")
    report = json.loads(done.stdout)
    assert report["failures"] == {}
    assert set(report["built"]) == KERNELS
    # The Gluon prefill's products overlap: ptxas did not serialize them (it
    # waits after every product when it does).
    builds = [len(report[name]) for name in ("gluon", "specialized", "persistent")]
    assert builds == [8, 12, 20], builds
    for products, waits in report["gluon"] + report["specialized"] + report["persistent"]:
        assert products >= 16 and waits * 4 <= products, report


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU builds and runs them for real")
def test_the_machine_code_report_counts_each_build(tmp_path: Path) -> None:
    """``pagedkv.bench.kernels.sass``: a row per kernel, cache dtype and
    head size, from ``cuobjdump``; a launch constant set off is named; the
    prefill kernel's copies stay in flight across a step."""
    output = tmp_path / "sass.json"
    setting = "paged_attention.PREFILL_INT8_SCALE_TILES=off"
    _run_module("pagedkv.bench.kernels.sass", "--output", str(output), "--set", setting)
    report = json.loads(output.read_text())
    assert report["settings"] == {"paged_attention.PREFILL_INT8_SCALE_TILES": False}
    keys = {(r["kernel"], r["kv_cache_dtype"], r["head_size"]) for r in report["rows"]}
    assert len(keys) == len(report["rows"]) == 2 * 3 * 2
    for row in report["rows"]:
        assert row["instructions"] > 500 and 0 < row["registers"] <= 255, row
        assert sum(row["top_opcodes"].values()) <= row["instructions"]
        if row["kernel"] == "prefill":  # the block table read ahead: copies overlap
            assert max(row["copy_waits"]) >= 2, row
    assert output.with_suffix(".md").read_text().startswith("# Attention kernels")
