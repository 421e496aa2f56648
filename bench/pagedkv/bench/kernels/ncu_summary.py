"""What Nsight Compute's source page says of a kernel, in a few lines: for
each ``-sass.csv`` that ``run-fp8-bench.sh ncu`` writes (ncu's source page,
every SASS instruction with its executions and its samples of stalled
warps), the share of samples by stall reason, the opcode mix of the main
loop (the instructions executed most often, together) and the
instructions that hold the most samples. The raw pages
are large; this summary is what results keep.

    python -m pagedkv.bench.kernels.ncu_summary --output FILE.md PAGE.csv ...
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from pathlib import Path
from typing import Any

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(source: str) -> str:
    words = source.split()
    if not words:
        return ""
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def summarize(path: Path, top: int = 8, lines: int = 5) -> dict[str, Any]:
    """A source page's stall reasons (shares of all samples), the main
    loop's length in instructions and its ``top`` opcodes, and the
    ``lines`` instructions with the most samples (each with its share and
    its main reason)."""
    rows = list(csv.reader(path.open()))
    header = next(i for i, row in enumerate(rows) if SAMPLES in row)
    names, data = rows[header], rows[header + 1 :]
    at = {name: i for i, name in enumerate(names)}
    reasons = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    samples = sum(_number(row[at[SAMPLES]]) for row in data) or 1.0
    stalls = Counter({r: sum(_number(row[at[r]]) for row in data) / samples for r in reasons})
    # The main loop: the execution count that accounts for most instructions.
    counts = Counter(int(_number(row[at[EXECUTED]])) for row in data)
    loop_count = max(counts, key=lambda n: n * counts[n])
    loop = [row for row in data if int(_number(row[at[EXECUTED]])) == loop_count]
    opcodes = Counter(_opcode(row[at["Source"]]) for row in loop)
    busiest = sorted(data, key=lambda row: -_number(row[at[SAMPLES]]))[:lines]
    return {
        "name": path.name.removesuffix("-sass.csv"),
        "stalls": {r.removeprefix("stall_"): round(s, 3) for r, s in stalls.most_common(top)},
        "loop_instructions": len(loop),
        "loop_opcodes": dict(opcodes.most_common(top)),
        "stalled_lines": [
            {
                "source": " ".join(row[at["Source"]].split()),
                "share": round(_number(row[at[SAMPLES]]) / samples, 3),
                "reason": max(reasons, key=lambda r: _number(row[at[r]]), default="").removeprefix(
                    "stall_"
                ),
            }
            for row in busiest
            if _number(row[at[SAMPLES]]) > 0
        ],
    }


def markdown(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "# Attention kernels under Nsight Compute (`python -m pagedkv.bench.kernels.ncu_summary`)",
        "",
        "From ncu's source page (`run-fp8-bench.sh ncu`): stalled warps' samples by "
        "reason, the main loop's instructions (a warp's, per iteration) by opcode, and "
        "the instructions that hold the most samples.",
    ]
    for summary in summaries:
        stalls = ", ".join(f"{r} {s:.0%}" for r, s in summary["stalls"].items())
        opcodes = ", ".join(f"{o} {n}" for o, n in summary["loop_opcodes"].items())
        lines += [
            "",
            f"## {summary['name']}",
            "",
            f"- stalls: {stalls}",
            f"- main loop: {summary['loop_instructions']} instructions; {opcodes}",
        ]
        for line in summary.get("stalled_lines", []):
            lines.append(f"- `{line['source']}`: {line['share']:.1%} of samples, {line['reason']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.kernels.ncu_summary")
    parser.add_argument("--output", required=True, type=Path, help="markdown")
    parser.add_argument("pages", nargs="+", type=Path, help="ncu source pages (-sass.csv)")
    args = parser.parse_args(argv)
    text = markdown([summarize(page) for page in args.pages])
    args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
