"""GPU idle time between decode steps, from a torch profiler Chrome trace.

The trace holds, per profiled step, a CPU range (``user_annotation`` named
``STEP_ANNOTATION``, from ``torch.profiler.record_function``), the CUDA API
calls made inside it (``cuda_runtime``/``cuda_driver``, each with a
``correlation`` id) and the GPU work they started (``kernel``,
``gpu_memcpy``, ``gpu_memset``, carrying the same ``correlation``; the
kernels of a CUDA graph replay carry their ``cudaGraphLaunch``'s). Each GPU
event is given to the step whose CPU range holds its launch.

Over the window from the first GPU event of the first step to the end of
the last step's GPU work:
- ``idle_fraction``: the share of the window with no GPU event running;
- ``between_steps_idle_fraction``: the part of that idle time that lies
  between one step's last GPU work and the next step's first (the host's
  time between steps: the step's reply, the scheduler, the next request),
  the rest being gaps inside steps (launch gaps);
- ``inside_launches_idle_us``: the part of the idle time that lies
  between the GPU events of one launch, that is between the kernels of one
  CUDA graph replay (the events of one correlation id): gaps the device
  leaves between a decode step's kernels, part of that step's GPU time
  whatever the host does. The rest, ``between_launches_idle_fraction``, is
  the time the GPU waited for the host to launch something: between the
  decode steps of a window (each its graph replay and its sampling) and
  between windows.
``gpu_busy`` measures a trace recorded with GPU activity only (no CPU ops,
so no step ranges and almost no host overhead from the profiler): the idle
share of the whole window from its first GPU event to its last, all of it
decode steps when the profiler ran over decode steps only.
``gpu_time_by_name`` says where the busy time went: each kernel (or copy)
name's GPU time per decode step, the most first.
Pure Python: no torch, so it is tested on synthetic traces.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

STEP_ANNOTATION = "pagedkv.decode_step"
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})


class GpuIdle(NamedTuple):
    """Times in microseconds of the profiler's clock."""

    num_steps: int  # steps with GPU work
    num_gpu_events: int
    window_us: float
    busy_us: float
    idle_us: float
    idle_fraction: float
    between_steps_idle_us: float
    between_steps_idle_fraction: float
    median_step_gpu_span_us: float  # first GPU start to last GPU end of a step
    median_gap_between_steps_us: float
    inside_launches_idle_us: float
    between_launches_idle_fraction: float


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _inside_launches_idle(gpu: Iterable[tuple[int, float, float]]) -> float:
    """The idle time inside each correlation id's GPU events (between the
    kernels of one graph replay), summed: span less busy time, per id."""
    by_launch: dict[int, list[tuple[float, float]]] = {}
    for correlation, start, end in gpu:
        by_launch.setdefault(correlation, []).append((start, end))
    return sum(
        max(e for _, e in spans) - min(s for s, _ in spans) - _union_length(spans)
        for spans in by_launch.values()
        if len(spans) > 1
    )


def _scan(
    events: Iterable[Mapping[str, Any]], step_name: str
) -> tuple[list[tuple[float, float]], dict[int, float], list[tuple[int, float, float]]]:
    """From a trace's complete events: the ``step_name`` ranges (sorted), the
    launches' start times by correlation id, and the GPU events as
    (correlation, start, end)."""
    steps: list[tuple[float, float]] = []
    launches: dict[int, float] = {}
    gpu: list[tuple[int, float, float]] = []
    for event in events:
        if event.get("ph") != "X":
            continue
        cat = event.get("cat", "")
        ts, dur = float(event["ts"]), float(event.get("dur", 0.0))
        if cat == "user_annotation" and event.get("name") == step_name:
            steps.append((ts, ts + dur))
        elif cat in LAUNCH_CATEGORIES and "correlation" in event.get("args", {}):
            launches[int(event["args"]["correlation"])] = ts
        elif cat in GPU_CATEGORIES and "correlation" in event.get("args", {}):
            gpu.append((int(event["args"]["correlation"]), ts, ts + dur))
    steps.sort()
    return steps, launches, gpu


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def gpu_idle(events: Iterable[Mapping[str, Any]], step_name: str = STEP_ANNOTATION) -> GpuIdle:
    """The idle measures of the module docstring over ``events`` (a Chrome
    trace's ``traceEvents``). AssertionError when no step has GPU work."""
    steps, launches, gpu = _scan(events, step_name)
    per_step: dict[int, list[tuple[float, float]]] = {}
    in_steps: list[tuple[int, float, float]] = []
    for correlation, start, end in gpu:
        launch = launches.get(correlation)
        i = None if launch is None else _step_of(steps, launch)
        if i is not None:
            per_step.setdefault(i, []).append((start, end))
            in_steps.append((correlation, start, end))
    assert per_step, "no GPU work launched inside a profiled step"
    order = sorted(per_step)
    spans = [(min(s for s, _ in per_step[i]), max(e for _, e in per_step[i])) for i in order]
    window_start, window_end = spans[0][0], max(end for _, end in spans)
    intervals = [interval for i in order for interval in per_step[i]]
    busy = _union_length(intervals)
    window = window_end - window_start
    inside = _inside_launches_idle(in_steps)
    gaps, reached = [], spans[0][1]
    for start, end in spans[1:]:
        gaps.append(max(0.0, start - reached))
        reached = max(reached, end)
    between = sum(gaps)
    return GpuIdle(
        num_steps=len(order),
        num_gpu_events=len(intervals),
        window_us=window,
        busy_us=busy,
        idle_us=window - busy,
        idle_fraction=(window - busy) / window if window else 0.0,
        between_steps_idle_us=between,
        between_steps_idle_fraction=between / window if window else 0.0,
        median_step_gpu_span_us=_median([end - start for start, end in spans]),
        median_gap_between_steps_us=_median(gaps),
        inside_launches_idle_us=inside,
        between_launches_idle_fraction=(window - busy - inside) / window if window else 0.0,
    )


class GpuBusy(NamedTuple):
    """Times in microseconds of the profiler's clock."""

    num_gpu_events: int
    window_us: float
    busy_us: float
    idle_us: float
    idle_fraction: float
    inside_launches_idle_us: float  # gaps inside one launch's GPU work (a graph replay)
    between_launches_idle_fraction: float


def gpu_busy(events: Iterable[Mapping[str, Any]]) -> GpuBusy:
    """The busy and idle time of every GPU event of ``events``, from the
    first one's start to the last one's end. AssertionError when there is
    no GPU event."""
    gpu = [
        (
            int(event.get("args", {}).get("correlation", -1 - i)),  # no id: a launch of its own
            float(event["ts"]),
            float(event["ts"]) + float(event.get("dur", 0.0)),
        )
        for i, event in enumerate(events)
        if event.get("ph") == "X" and event.get("cat", "") in GPU_CATEGORIES
    ]
    assert gpu, "no GPU event in the trace"
    intervals = [(start, end) for _, start, end in gpu]
    window = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = _union_length(intervals)
    inside = _inside_launches_idle(gpu)
    return GpuBusy(
        num_gpu_events=len(intervals),
        window_us=window,
        busy_us=busy,
        idle_us=window - busy,
        idle_fraction=(window - busy) / window if window else 0.0,
        inside_launches_idle_us=inside,
        between_launches_idle_fraction=(window - busy - inside) / window if window else 0.0,
    )


class NamedGpuTime(NamedTuple):
    name: str  # the kernel's (or copy's) name, cut to NAME_LENGTH characters
    us_per_step: float  # GPU time per decode step, summed over its launches
    launches_per_step: float


NAME_LENGTH = 96


def _launched_in_steps(events: Sequence[Mapping[str, Any]], step_name: str) -> set[int]:
    """The correlation ids of the launches made inside a ``step_name`` range."""
    steps, launches, _ = _scan(events, step_name)
    return {c for c, ts in launches.items() if _step_of(steps, ts) is not None}


def _step_of(steps: Sequence[tuple[float, float]], ts: float) -> int | None:
    """The index of the (sorted, disjoint) step range holding ``ts``, or None."""
    i = bisect.bisect_right(steps, (ts, float("inf"))) - 1
    return i if i >= 0 and ts <= steps[i][1] else None


def gpu_time_by_name(
    events: Iterable[Mapping[str, Any]],
    num_decode_steps: int,
    top: int = 16,
    step_name: str | None = None,
) -> list[NamedGpuTime]:
    """The ``top`` GPU event names by their GPU time in ``events`` (the
    profiled window), per decode step, the most first. With ``step_name``,
    only the GPU work launched inside those step ranges counts (a profiler
    also records steps launched, uncounted, while it stops)."""
    events = list(events)
    counted = None if step_name is None else _launched_in_steps(events, step_name)
    totals: dict[str, list[float]] = {}
    for event in events:
        if event.get("ph") != "X" or event.get("cat", "") not in GPU_CATEGORIES:
            continue
        if counted is not None and event.get("args", {}).get("correlation") not in counted:
            continue
        name = str(event.get("name", ""))[:NAME_LENGTH]
        entry = totals.setdefault(name, [0.0, 0.0])
        entry[0] += float(event.get("dur", 0.0))
        entry[1] += 1
    steps = max(1, num_decode_steps)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [
        NamedGpuTime(name, round(total / steps, 2), round(count / steps, 2))
        for name, (total, count) in ranked
    ]
