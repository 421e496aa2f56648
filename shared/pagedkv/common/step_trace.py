"""Step traces: when each step reached each stage, in every process of a stack.

A measuring aid for finding where a step's time goes between the scheduler
and its executors. Off unless the environment variable ``PAGEDKV_STEP_TRACE``
names a folder; then each process that steps (a scheduler's step loops, an
executor's steps) keeps one record per step and, at exit, writes them to
``FOLDER/ROLE-PID.json`` as ``{"role", "pid", "fields", "records"}``. Times
are ``time.perf_counter()``: CLOCK_MONOTONIC on Linux, one clock for all the
host's processes, so records of different processes line up. CPU times are
``time.process_time()`` of the recording process.

``pagedkv bench serve --step-trace`` runs a fixed batch with tracing on and
reads the files with ``pagedkv.bench.scheduler.step_trace``.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from pathlib import Path

ENV = "PAGEDKV_STEP_TRACE"
MAX_RECORDS = 1_000_000  # a trace stops growing here (about 100 MB of tuples)


class StepTrace:
    """The records of one process (appended from any thread)."""

    def __init__(self, path: Path, role: str, fields: tuple[str, ...]) -> None:
        self.path = path
        self.role = role
        self.fields = fields
        self.records: list[tuple[float | int, ...]] = []
        self._written = threading.Lock()

    def add(self, *record: float | int) -> None:
        if len(self.records) < MAX_RECORDS:
            self.records.append(record)

    def write(self) -> None:
        """Writes the records (once; later calls do nothing)."""
        if not self._written.acquire(blocking=False):
            return
        document = {
            "role": self.role,
            "pid": os.getpid(),
            "fields": list(self.fields),
            "records": self.records,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(document))
        temporary.replace(self.path)  # a reader never sees half a file


def step_trace(role: str, fields: tuple[str, ...]) -> StepTrace | None:
    """This process's trace for ``role``, written at exit; None when tracing
    is off (``PAGEDKV_STEP_TRACE`` unset or empty)."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    trace = StepTrace(Path(folder) / f"{role}-{os.getpid()}.json", role, fields)
    atexit.register(trace.write)
    return trace
