"""``python -m pagedkv.executor.timeline --timeline-dir D [--skip-steps K]
[--steps N] EXECUTOR-ARGS``: an executor (the same as ``python -m
pagedkv.executor EXECUTOR-ARGS``) that profiles N decode steps twice, after
skipping the first K, and measures the GPU's idle time between them
(``pagedkv.executor.gpu_idle``): first recording GPU activity only (the
idle share of the whole window, with almost no host overhead from the
profiler), then GPU and CPU activity (the steps' ranges, so idle time
between steps and inside them apart, and each kernel's time).

A decode step is a step with no new request and one token for every row;
a decode window (``num_decode_steps``) counts as its steps, and profiling
starts at the first whole window after the K skipped steps. Each profiled
step message runs inside ``record_function(STEP_ANNOTATION)``; once N decode
steps have run under the GPU-only profiler, its measures are kept (under
``gpu_only``) and the second profiler starts; once N more have run, it
stops, its trace goes to ``D/trace.json.gz`` and all the measures (with each
kernel's GPU time per decode step) to ``D/timeline.json`` (written last: its
presence says the measurement is complete); the executor goes on serving.
The second profiler records CPU ops (the step ranges need them), which adds
host time per op, so its idle fractions are upper bounds of the unprofiled
ones. Used by ``pagedkv bench serve --timeline-steps N``.

This process is a measuring tool: ``Executor`` is replaced, in this process
only, by a subclass whose ``step`` does the counting and profiling.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pagedkv.executor import engine
from pagedkv.executor.gpu_idle import STEP_ANNOTATION, gpu_busy, gpu_idle, gpu_time_by_name
from pagedkv.executor.launched import LaunchedStep
from pagedkv.v1 import executor_pb2


def _all_threads_profiler(activities: list[ProfilerActivity]) -> tuple[Any, bool]:
    """A profiler of ``activities`` that follows every thread (the server
    runs steps on a pool of threads: the profiler is started on the thread
    that launches a step and stopped on the one that completes another), and
    whether it does: a torch without that option records the starting
    thread's ops only, so steps run on other threads go unmeasured."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        config = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return profile(activities=activities), False
    return profile(activities=activities, experimental_config=config), True


def _gpu_only_profiler() -> Any:
    """A profiler of GPU activity only (without a CUDA device, of CPU
    activity, whose trace then holds no GPU event to measure)."""
    cuda = torch.cuda.is_available()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    return _all_threads_profiler([activity])[0]


class StepProfiler:
    """Counts decode steps and profiles steps ``skip`` .. ``skip + steps - 1``
    with GPU activity only, then the next ``steps`` with CPU activity too."""

    def __init__(self, directory: Path, skip: int, steps: int) -> None:
        self.directory, self.skip, self.steps = directory, skip, steps
        self.num_decode_steps = 0
        self.num_profiled = 0  # in the current phase
        self.profiler: Any = None
        self.gpu_only: dict[str, Any] | None = None  # the first phase's measures, once done
        self.all_threads = False
        self.done = False
        self.lock = threading.Lock()

    @staticmethod
    def is_decode(request: executor_pb2.StepRequest) -> bool:
        scheduled = request.num_scheduled_tokens
        return not request.new_requests and len(scheduled) > 0 and max(scheduled) == 1

    def around(self, request: executor_pb2.StepRequest) -> bool:
        """Before a step: whether to profile it (starts the profiler at the first)."""
        with self.lock:
            if self.done or not self.is_decode(request):
                return False
            num_steps = max(1, request.num_decode_steps)
            self.num_decode_steps += num_steps
            if self.num_decode_steps - num_steps < self.skip:
                return False
            self.num_profiled += num_steps
            if self.profiler is None:
                if self.gpu_only is None:
                    self.profiler = _gpu_only_profiler()
                else:
                    self.profiler, self.all_threads = _all_threads_profiler(
                        [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                    )
                self.profiler.start()
            return True

    def after(self) -> None:
        """After a profiled step: ends the phase once ``steps`` have run in it
        (after the second, writes the measures)."""
        with self.lock:
            if self.done or self.num_profiled < self.steps:
                return
            if self.gpu_only is None:
                self.gpu_only = {
                    "skipped_decode_steps": self.num_decode_steps - self.num_profiled,
                    "profiled_decode_steps": self.num_profiled,
                }
                try:
                    self.gpu_only |= self._stop_and_measure_gpu_only()
                except Exception as exc:  # the measure fails, never the step
                    self.gpu_only["error"] = f"{type(exc).__name__}: {exc}"
                self.profiler, self.num_profiled = None, 0
                return
            self.done = True
            measures: dict[str, Any] = {
                "skipped_decode_steps": self.num_decode_steps - self.num_profiled,
                "profiled_decode_steps": self.num_profiled,
                "profiled_all_threads": self.all_threads,
            }
            try:
                measures |= self._stop_and_measure()
            except Exception as exc:  # the measure fails, never the step
                measures["error"] = f"{type(exc).__name__}: {exc}"
            measures["gpu_only"] = self.gpu_only
            (self.directory / "timeline.json").write_text(json.dumps(measures, indent=2) + "\n")

    def _stopped_events(self) -> list[dict[str, Any]]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        trace = self.directory / "trace.json"
        self.profiler.export_chrome_trace(str(trace))
        events: list[dict[str, Any]] = json.loads(trace.read_text())["traceEvents"]
        trace.unlink()
        return events

    def _stop_and_measure_gpu_only(self) -> dict[str, Any]:
        return dict(gpu_busy(self._stopped_events())._asdict())

    def _stop_and_measure(self) -> dict[str, Any]:
        events = self._stopped_events()
        with gzip.open(self.directory / "trace.json.gz", "wt") as packed:
            json.dump({"traceEvents": events}, packed)
        kernels = gpu_time_by_name(events, self.num_profiled, step_name=STEP_ANNOTATION)
        return {**gpu_idle(events)._asdict(), "gpu_time_by_name": [k._asdict() for k in kernels]}


def profiled_executor(profiler: StepProfiler) -> type[engine.Executor]:
    class ProfiledExecutor(engine.Executor):
        def launch(
            self, request: executor_pb2.StepRequest, session: int | None = None
        ) -> LaunchedStep:
            if not profiler.around(request):
                return super().launch(request, session)
            with record_function(STEP_ANNOTATION):
                return super().launch(request, session)

        def complete(self, launched: LaunchedStep) -> executor_pb2.StepResponse:
            response = super().complete(launched)
            profiler.after()
            return response

    return ProfiledExecutor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.executor.timeline", add_help=False)
    parser.add_argument("--timeline-dir", required=True, type=Path)
    parser.add_argument("--skip-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    profiler = StepProfiler(args.timeline_dir, args.skip_steps, args.steps)
    engine.Executor = profiled_executor(profiler)  # type: ignore[misc]
    from pagedkv.executor.__main__ import main as executor_main

    return executor_main(rest)


if __name__ == "__main__":
    sys.exit(main())
