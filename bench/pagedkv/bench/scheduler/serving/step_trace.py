"""Where a step's time goes, from the step traces of a scheduler and its
executor (``pagedkv.common.step_trace``).

``analyze(folder, since, until)`` reads the traces written in ``folder`` and
looks at the steps the scheduler began in that time (``time.perf_counter()``):

- ``device_busy_fraction``: the share of the span, from the first step's
  device start to the last one's device end, in which the device ran a step;
- each gap between one step's device end and the next one's device start
  splits into ``late_send`` (the scheduler had not yet sent the next step),
  ``in_transit`` (sent, not yet read by the executor) and ``launching`` (read,
  its device work not yet started: the executor's launch);
- the median time of each stage of a step, in both processes (the
  executor's launch also split into decoding its plan, applying it to the
  rows and running it, and the launching thread's CPU time over the launch:
  the rest of the launch's wall time it waited, for the GIL or the device);
- each process's CPU use over the span (CPU seconds per second: above 1 means
  more than one thread was busy);
- ``device_ms_by_kind``: the device time of the steps that computed prompt
  tokens (``prefill``: more tokens than decode steps' worth) and of the
  others (``decode``), each split by whether the step loaded host-tier
  blocks, with the steps and blocks of each (``host_copies``: the blocks
  offloaded and loaded in all).

Only the scheduler's and one executor's records are used (the serving
benchmark runs one executor).
``python -m pagedkv.bench.scheduler.serving.step_trace FOLDER`` prints the
analysis as JSON.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedkv.common.step_trace import ENV

# (name, stage end, stage start) of the median stage times, per process
SCHEDULER_STAGES = (
    ("schedule", "scheduled", "scheduling"),
    ("send", "sent", "scheduled"),
    ("process", "processed", "received"),
)
EXECUTOR_STAGES = (
    ("launch", "launched", "received"),
    ("plan", "planned", "received"),
    ("apply", "applied", "planned"),
    ("run", "ran", "applied"),
    ("device", "device_end", "device_start"),
    ("seen_done_after_device", "done", "device_end"),
    ("respond", "completed", "done"),
)


@contextlib.contextmanager
def tracing(folder: str | None) -> Iterator[None]:
    """Children started inside trace their steps into ``folder`` (None: as
    this process's environment says)."""
    if folder is None:
        yield
        return
    previous = os.environ.get(ENV)
    os.environ[ENV] = folder
    try:
        yield
    finally:
        if previous is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = previous


def records(folder: Path, role: str) -> list[dict[str, float]]:
    """The step records of the first trace of ``role`` in ``folder``, as dicts."""
    files = sorted(folder.glob(f"{role}-*.json"))
    if not files:
        raise FileNotFoundError(f"no {role} step trace in {folder}")
    document = json.loads(files[0].read_text())
    fields = document["fields"]
    return [dict(zip(fields, record, strict=True)) for record in document["records"]]


def _median_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 1) if values else 0.0


def _cpu_use(records: list[dict[str, float]], clock: str) -> float:
    if len(records) < 2:
        return 0.0
    seconds = records[-1][clock] - records[0][clock]
    return round((records[-1]["cpu"] - records[0]["cpu"]) / seconds, 3) if seconds else 0.0


def analyze(folder: Path, since: float = 0.0, until: float = math.inf) -> dict[str, Any]:
    """The measures above, of the steps begun between ``since`` and ``until``."""
    scheduler = [r for r in records(folder, "scheduler") if since <= r["scheduling"] < until]
    sent = {int(r["step_id"]): r for r in scheduler}
    # A step id names one step of one scheduler: an executor that served
    # several schedulers in turn saw each id more than once, and its record
    # of this step is the one read between its scheduling and its answer.
    executor = [
        r
        for r in records(folder, "executor")
        if (step := sent.get(int(r["step_id"]))) is not None
        and step["scheduling"] <= r["received"] <= step["received"]
    ]
    executor.sort(key=lambda r: r["device_start"])
    if len(executor) < 2:
        raise ValueError(f"{len(executor)} traced steps after the mark: too few to analyze")
    span = executor[-1]["device_end"] - executor[0]["device_start"]
    busy = 0.0
    reach = executor[0]["device_start"]  # the device is accounted for up to here
    gaps = {"late_send": 0.0, "in_transit": 0.0, "launching": 0.0}
    for step in executor:
        start, end = step["device_start"], step["device_end"]
        if start > reach:  # an idle gap before this step: why did it start late?
            sent_at = sent[int(step["step_id"])]["sent"]
            late = min(max(sent_at - reach, 0.0), start - reach)
            transit = min(max(step["received"] - max(sent_at, reach), 0.0), start - reach - late)
            gaps["late_send"] += late
            gaps["in_transit"] += transit
            gaps["launching"] += start - reach - late - transit
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    decode_steps = sum(int(r["num_steps"]) for r in executor)
    by_kind = _device_by_kind(executor, sent)
    return {
        "steps": len(executor),
        "decode_steps": decode_steps,  # a window of N counts N
        "windows": sum(1 for r in executor if r["num_steps"] > 1),
        "span_ms": round(span * 1e3, 2),
        "device_busy_fraction": round(busy / span, 4) if span else 0.0,
        "idle_ms": {name: round(seconds * 1e3, 2) for name, seconds in gaps.items()},
        "wall_per_decode_step_us": round(span / decode_steps * 1e6, 1),
        "median_us": {
            **{
                f"scheduler_{name}": _median_us([r[end] - r[start] for r in scheduler])
                for name, end, start in SCHEDULER_STAGES
            },
            "request_transit": _median_us(
                [r["received"] - sent[int(r["step_id"])]["sent"] for r in executor]
            ),
            **{
                f"executor_{name}": _median_us([r[end] - r[start] for r in executor])
                for name, end, start in EXECUTOR_STAGES
            },
            "executor_launch_cpu": _median_us([r["launch_cpu"] for r in executor]),
            "response_transit": _median_us(
                [sent[int(r["step_id"])]["received"] - r["completed"] for r in executor]
            ),
            "scheduler_received_to_next_sent": _median_us(
                [b["sent"] - a["received"] for a, b in itertools.pairwise(scheduler)]
            ),
        },
        "cpu_use": {
            "scheduler": _cpu_use(scheduler, "processed"),
            "executor": _cpu_use(executor, "completed"),
        },
        "device_ms_by_kind": by_kind,
        "host_copies": {
            "offloaded_blocks": int(sum(r.get("offloads", 0) for r in executor)),
            "loaded_blocks": int(sum(r.get("loads", 0) for r in executor)),
        },
    }


def _device_by_kind(
    executor: list[dict[str, float]], sent: dict[int, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Device ms, steps, tokens and loaded blocks of each kind of step: ``prefill`` or
    ``decode`` (a step whose tokens exceed its entries times its decode
    steps computed prompt tokens), ``+loads`` when it loaded host blocks;
    ``copies`` for a step with no entries (an idle executor's offloads)."""
    kinds: dict[str, dict[str, float]] = {}
    for r in executor:
        step = sent[int(r["step_id"])]
        prefill = step["tokens"] > step["entries"] * max(1, step["num_steps"])
        loads = int(r.get("loads", 0))
        kind = ("prefill" if prefill else "decode") + ("+loads" if loads else "")
        if not step["entries"]:
            kind = "copies"
        row = kinds.setdefault(
            kind, {"steps": 0, "tokens": 0, "device_ms": 0.0, "loaded_blocks": 0}
        )
        row["steps"] += 1
        row["tokens"] += int(step["tokens"])
        row["device_ms"] += (r["device_end"] - r["device_start"]) * 1e3
        row["loaded_blocks"] += loads
    for row in kinds.values():
        row["device_ms"] = round(row["device_ms"], 2)
    return dict(sorted(kinds.items()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pagedkv.bench.scheduler.serving.step_trace FOLDER", file=sys.stderr)
        return 2
    print(json.dumps(analyze(Path(args[0])), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
