"""``pagedkv.bench.kernels.ncu_summary`` on a source page shaped as ncu
writes it: a kernel-name line, the header, then one row per SASS
instruction (counts with thousands separators)."""

from __future__ import annotations

import csv
from pathlib import Path

from pagedkv.bench.kernels import ncu_summary

HEADER = [
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Instructions Executed",
    "stall_long_sb",
    "stall_barrier",
    "stall_long_sb (Not Issued)",
]
ROWS = [  # a prologue run once, a three-instruction loop run 1,024 times, an epilogue
    ["0x00", "MOV R1, c[0x0][0x28]", "1", "8", "0", "1", "0"],
    ["0x10", "LDG.E.128 R4, [R2.64]", "30", "1,024", "30", "0", "9"],
    ["0x20", "HMMA.16816.F32 R8, R4, R6, R8", "5", "1,024", "0", "5", "0"],
    ["0x30", "@P0 BRA 0x10", "4", "1,024", "0", "4", "0"],
    ["0x40", "EXIT", "0", "8", "0", "0", "0"],
]


def test_a_page_gives_its_stall_shares_and_its_loops_opcodes(tmp_path: Path) -> None:
    page = tmp_path / "ncu-decode-x-h100-sass.csv"
    with page.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["Kernel Name", "_decode_split_kernel"])
        writer.writerow(HEADER)
        writer.writerows(ROWS)
    summary = ncu_summary.summarize(page)
    assert summary["name"] == "ncu-decode-x-h100"
    assert summary["stalls"] == {"long_sb": 0.75, "barrier": 0.25}
    assert summary["loop_instructions"] == 3
    assert summary["loop_opcodes"] == {"LDG.E.128": 1, "HMMA.16816.F32": 1, "BRA": 1}
    assert summary["stalled_lines"][:2] == [
        {"source": "LDG.E.128 R4, [R2.64]", "share": 0.75, "reason": "long_sb"},
        {"source": "HMMA.16816.F32 R8, R4, R6, R8", "share": 0.125, "reason": "barrier"},
    ]
    output = tmp_path / "summary.md"
    assert ncu_summary.main(["--output", str(output), str(page)]) == 0
    text = output.read_text()
    assert "long_sb 75%" in text and "main loop: 3 instructions" in text
    assert "`LDG.E.128 R4, [R2.64]`: 75.0% of samples, long_sb" in text
