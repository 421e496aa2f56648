"""The event loop's lag: how late the loop runs what is due.

``LoopLag`` keeps a task on the loop that asks to wake every ``interval``
seconds and reports how much later than asked it woke (``observe``, in
seconds). A loop busy with one long callback (a prompt encoded inline, a
large message parsed) delays every stream, health check and Redis call of
the process by as much; the lag shows it. A stall is reported when it ends,
as one lag as long as the stall. ``ThreadLag`` measures the same for a
process of threads without an event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from pagedkv.common.tasks import cancel_and_wait

LAG_INTERVAL_S = 0.1
"""Seconds between two measures."""

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram edges (seconds): an idle loop is late by well under a
millisecond, a loaded one by a few; past 100 ms streams and health checks
feel it, past a lease TTL (3 s) executors can be lost."""


class LoopLag:
    """Measures the running loop's lag every ``interval`` seconds into
    ``observe`` (see the module docstring). ``start`` on the loop to measure;
    ``stop`` cancels the task."""

    def __init__(self, observe: Callable[[float], None], interval: float = LAG_INTERVAL_S) -> None:
        self.observe = observe
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def _run(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.interval)
            self.observe(max(time.monotonic() - asked - self.interval, 0.0))


class ThreadLag:
    """The same measure for a process without an event loop (the executor):
    a daemon thread asks to wake every ``interval`` seconds and reports how
    much later it woke into ``observe``. Its threads share the interpreter,
    so one that holds the GIL long (a C call that does not release it) delays
    every other, this one included. ``stop`` ends the thread."""

    def __init__(self, observe: Callable[[float], None], interval: float = LAG_INTERVAL_S) -> None:
        self.observe = observe
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-lag", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            asked = time.monotonic()
            if self._stop.wait(self.interval):
                return
            self.observe(max(time.monotonic() - asked - self.interval, 0.0))
