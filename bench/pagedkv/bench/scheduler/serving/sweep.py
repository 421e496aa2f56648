"""``pagedkv bench serve --sweep W:D,...``: the fixed batches under several
scheduler settings, on one executor.

Each setting ``W:D`` (``--decode-window`` W, ``--pipeline-depth`` D) gets a
fresh ``pagedkv scheduler`` over the same executor process, which it takes
over with the epoch after the last one's; the executor's start-up (model
load, kernel compilation, CUDA graph capture) is paid once, and a device's
time goes to the runs. Each setting runs the warm-up requests, then every
fixed batch on prompts of its own (a scheduler adopts the executor's cached
blocks, so a prompt another setting ran would come from the prefix cache).
Both processes trace their steps (``pagedkv.common.step_trace``), and each
batch's report says where its step time went (``step_trace.analyze``). No
Poisson rates, no Hugging Face, no timeline: those are ``pagedkv bench
serve`` without ``--sweep``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from pagedkv.bench.scheduler.serving import step_trace
from pagedkv.bench.scheduler.serving.metrics import Slo, failure_note, ms_cell
from pagedkv.bench.scheduler.serving.runs import (
    FixedBatch,
    mix_config,
    run_fixed_batches,
    warm_up,
)
from pagedkv.bench.scheduler.serving.stack import start_scheduler
from pagedkv.scheduler.child_commands import executor_commands
from pagedkv.scheduler.children import ExecutorProcesses


class Setting(NamedTuple):
    decode_window: int
    pipeline_depth: int

    @property
    def label(self) -> str:
        return f"{self.decode_window}:{self.pipeline_depth}"


def parse_settings(text: str) -> list[Setting]:
    """``"1:2,8:3"`` -> window 1 at depth 2, window 8 at depth 3."""
    settings = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        numbers = part.split(":")
        if len(numbers) != 2 or not all(n.isdigit() and int(n) >= 1 for n in numbers):
            raise ValueError(f"a sweep setting is WINDOW:DEPTH, both >= 1, not {part!r}")
        settings.append(Setting(int(numbers[0]), int(numbers[1])))
    if not settings:
        raise ValueError("a sweep needs a setting")
    return settings


def run_sweep(args: argparse.Namespace, model: str, batches: list[FixedBatch]) -> dict[str, Any]:
    """The report's ``sweep`` part: per setting, its fixed batches and their
    step-trace analyses."""
    settings = parse_settings(args.sweep)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    mix = mix_config(args, model, 0)
    with tempfile.TemporaryDirectory(prefix="pagedkv-sweep-") as folder:
        root = Path(folder)
        options = argparse.Namespace(**vars(args))
        options.executors, options.log_format, options.log_level = 1, "console", "warning"
        with step_trace.tracing(str(root / "executor")):
            executor = ExecutorProcesses(executor_commands(options, model))
        done: list[tuple[Setting, list[dict[str, Any]], list[float]]] = []
        try:
            for i, setting in enumerate(settings):
                options.decode_window, options.pipeline_depth = setting
                with step_trace.tracing(str(root / f"setting-{i}")):
                    scheduler = start_scheduler(options, model, executor.addresses[0])
                try:
                    target = scheduler.addresses[0]
                    warm_up(args, target, mix)
                    seed = args.seed + 1000 + 100 * i
                    rows, marks = run_fixed_batches(target, batches, mix.vocab_size, slo, seed)
                finally:
                    scheduler.stop()  # its trace is written as it exits
                done.append((setting, rows, marks))
        finally:
            executor.stop()
        traces = sorted((root / "executor").glob("executor-*.json"))
        runs = []
        for i, (setting, rows, marks) in enumerate(done):
            for trace in traces:
                shutil.copy(trace, root / f"setting-{i}")
            for j, row in enumerate(rows):
                since, until = marks[2 * j], marks[2 * j + 1]
                try:
                    row["step_trace"] = step_trace.analyze(root / f"setting-{i}", since, until)
                except ValueError as exc:  # too few steps to say anything
                    row["step_trace"] = {"error": str(exc)}
            runs.append({"setting": setting._asdict(), "fixed_batches": rows})
    return {"settings": [s.label for s in settings], "runs": runs}


def markdown_lines(sweep: dict[str, Any]) -> list[str]:
    """A table row per setting and batch."""
    lines = [
        "## Scheduler settings on one executor (`--sweep`)",
        "",
        "Window: `--decode-window`; depth: `--pipeline-depth`. Device busy, wall per "
        "decode step and CPU use (CPU seconds per second) come from the step traces of the "
        "batch's steps.",
        "",
        "| window | depth | requests x (prompt -> output) | output tok/s | TTFT p50 (ms) | "
        "TPOT p50/p99 (ms) | device busy | wall per decode step (us) | windows | "
        "CPU scheduler / executor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for run in sweep["runs"]:
        setting = run["setting"]
        for row in run["fixed_batches"]:
            s, t = row["pagedkv"], row["step_trace"]
            traced = (
                f"{t['error']} | | | |"
                if "error" in t
                else f"{100 * t['device_busy_fraction']:.1f}% | "
                f"{t['wall_per_decode_step_us']:.0f} | {t['windows']} | "
                f"{t['cpu_use']['scheduler']:.2f} / {t['cpu_use']['executor']:.2f} |"
            )
            lines.append(
                f"| {setting['decode_window']} | {setting['pipeline_depth']} | "
                f"{row['batch']} x ({row['prompt_len']} -> {row['max_tokens']}) | "
                f"{s['output_tokens_per_s']:.0f} | {ms_cell(s['ttft_ms'], ('p50',), 1)} | "
                f"{ms_cell(s['tpot_ms'], ('p50', 'p99'), 2)} | {traced}"
            )
            notes += failure_note(
                f"{setting['decode_window']}:{setting['pipeline_depth']}, "
                f"{row['batch']} x ({row['prompt_len']} -> {row['max_tokens']})",
                s,
            )
    return lines + (["", *notes] if notes else [])


def best_setting(sweep: dict[str, Any], targets: dict[int, float]) -> Setting:
    """The setting whose worst batch comes closest to its target: the
    largest of min(output tok/s / target) over the batches with a target
    (``targets``: batch size -> output tok/s)."""

    def score(run: dict[str, Any]) -> float:
        ratios = [
            float(b["pagedkv"]["output_tokens_per_s"]) / targets[b["batch"]]
            for b in run["fixed_batches"]
            if b["batch"] in targets
        ]
        if not ratios:
            raise ValueError(f"no batch of the sweep has a target ({sorted(targets)})")
        return min(ratios)

    best = max(sweep["runs"], key=score)
    return Setting(**best["setting"])


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedkv.bench.scheduler.serving.sweep REPORT.json
    BATCH=TOK_S ...`` prints the best setting of a sweep's report as
    ``WINDOW DEPTH`` (for the GPU recipe's next runs)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    report = json.loads(Path(args[0]).read_text())
    targets = {int(k): float(v) for k, v in (a.split("=") for a in args[1:])}
    setting = best_setting(report["sweep"], targets)
    print(setting.decode_window, setting.pipeline_depth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
