"""A step whose work is on the device and whose response is not made yet.

``Executor.launch`` applies a step and enqueues its forward, sampling and the
copies of its samples to pinned host memory; the device runs them while the
host goes on (to the next step's launch: see step_pipeline.py).
``Executor.complete`` waits for the step's last event and makes its response
from host memory. On the CPU every step has finished when its launch returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.common.ids import BlockId
from pagedkv.executor.block_tags import TagColumns
from pagedkv.executor.sampler import SamplerOutput
from pagedkv.v1 import executor_pb2

# A step's record in a step trace (pagedkv.common.step_trace): perf_counter
# times when it came in, was decoded (its plan), applied to the rows, run
# (its device work enqueued), launched, seen done and answered; the
# launching thread's CPU seconds over its launch (against the launch's wall
# time: the rest waited, for the GIL or the device); when its device work
# started and ended (CUDA events, on the same clock); the process's CPU
# seconds; the host tier's blocks it offloaded and loaded.
TRACE_FIELDS = (
    "step_id",
    "rows",
    "num_steps",
    "received",
    "planned",
    "applied",
    "ran",
    "launched",
    "launch_cpu",
    "done",
    "completed",
    "device_start",
    "device_end",
    "cpu",
    "offloads",
    "loads",
)


class HostSamples:
    """A step's samples on their way to host memory (no wait at creation)."""

    def __init__(self, result: SamplerOutput, num_logprobs: list[int]) -> None:
        self.num_logprobs = num_logprobs  # per sampled row, as its params were at launch
        columns = [result.token_ids, result.logprobs]
        if result.top_token_ids.shape[1]:
            columns += [result.top_token_ids, result.top_logprobs]
        if result.token_ids.device.type == "cuda":
            host = [torch.empty(c.shape, dtype=c.dtype, pin_memory=True) for c in columns]
            for destination, column in zip(host, columns, strict=True):
                destination.copy_(column, non_blocking=True)
            columns = host
        self._columns = columns  # read only once the step's end event has passed

    def fill(self, rows: np.ndarray, response: executor_pb2.StepResponse) -> None:
        """Writes the samples of ``rows`` into a StepResponse (the device is done)."""
        token_ids, logprobs, *top = self._columns
        response.sampled_rows.extend(rows.tolist())
        response.sampled_token_ids.extend(token_ids.tolist())
        response.sampled_logprobs.extend(logprobs.tolist())
        if not top:
            response.num_top_logprobs.extend([0] * len(rows))
            return
        top_ids, top_logprobs = (column.tolist() for column in top)
        for i, k in enumerate(self.num_logprobs):
            response.num_top_logprobs.append(k)
            response.top_token_ids.extend(top_ids[i][:k])
            response.top_logprobs.extend(top_logprobs[i][:k])


@dataclass(slots=True)
class LaunchedStep:
    """One launched step: what its response needs, and its device events."""

    sequence: int  # launch order on this executor
    step_id: int
    received: float  # time.perf_counter() when the request came in
    sampled_rows: np.ndarray
    samples: HostSamples | None
    tags: TagColumns  # set in launch order, at the latest when the step completes
    # The blocks of the rows it freed, in the order a scheduler releases them:
    # moved to the end of the tag order after its tags are set.
    released: list[BlockId]
    start: torch.cuda.Event | float  # device clock before the step's work
    end: torch.cuda.Event | float  # after its last work (the samples' copies)
    num_steps: int = 1  # decode steps (a window's)
    # time.perf_counter() when its plan was decoded, applied to the rows and
    # run (its device work enqueued), and when its launch returned; the
    # launching thread's CPU seconds over the launch.
    phases: tuple[float, float, float] = (0.0, 0.0, 0.0)
    launched: float = 0.0
    launch_cpu: float = 0.0
    host_copies: tuple[int, int] = (0, 0)  # blocks offloaded and loaded first

    def done(self) -> bool:
        """Whether the device has finished the step (never waits)."""
        return not isinstance(self.end, torch.cuda.Event) or self.end.query()

    def wait(self) -> None:
        """Returns once the device has finished the step."""
        if isinstance(self.end, torch.cuda.Event):
            self.end.synchronize()

    def device_time_us(self) -> int:
        """The step's device time (once done): between its events on CUDA, its
        launch's wall time on the CPU (where a launch runs the work)."""
        if isinstance(self.start, torch.cuda.Event):
            assert isinstance(self.end, torch.cuda.Event)
            return int(self.start.elapsed_time(self.end) * 1000)
        assert isinstance(self.end, float)
        return int((self.end - self.start) * 1e6)


_free_events: list[torch.cuda.Event] = []  # timing events no step holds (made once, reused)


def device_clock(device: torch.device) -> torch.cuda.Event | float:
    """A point on the device's clock: a recorded event on CUDA, else the time."""
    if device.type == "cuda":
        try:
            event = _free_events.pop()
        except IndexError:
            event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


class DeviceOrigin:
    """Puts a step's device clocks on the host's ``time.perf_counter()``
    (step traces): an event recorded while the device is idle, and the host
    time once it has passed."""

    def __init__(self, device: torch.device) -> None:
        self.event: torch.cuda.Event | None = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
            self.event.synchronize()
        self.time = time.perf_counter()

    def span(self, step: LaunchedStep) -> tuple[float, float]:
        """When a completed step's device work started and ended."""
        if isinstance(step.start, torch.cuda.Event):
            assert self.event is not None and isinstance(step.end, torch.cuda.Event)
            origin = self.event
            return (
                self.time + origin.elapsed_time(step.start) * 1e-3,
                self.time + origin.elapsed_time(step.end) * 1e-3,
            )
        assert isinstance(step.start, float) and isinstance(step.end, float)
        return step.start, step.end


def release_clocks(step: LaunchedStep) -> None:
    """Gives a completed step's events back for later steps to record."""
    for clock in (step.start, step.end):
        if isinstance(clock, torch.cuda.Event):
            _free_events.append(clock)
