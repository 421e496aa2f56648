"""How long ``pagedkv serve``'s children and temporary directories live: no
longer than ``pagedkv serve`` itself, however it ends.

- ``dying_with_parent``, a command's wrapper: on Linux the child gets
  SIGKILL when the thread that started it ends (``prctl(PR_SET_PDEATHSIG)``),
  so a SIGKILL of ``pagedkv serve`` takes its executors, schedulers, routers and
  redis-server with it. Elsewhere it does nothing (a clean stop still stops
  every child).
- ``Reaper``: a small child process of its own session that removes the
  temporary directories it was told of once ``pagedkv serve`` is gone (its
  stdin reaches end of file: closed on a clean exit, or by the kernel when
  the parent dies).
- ``StopSignals``: SIGTERM and SIGINT. The first asks for a clean stop, any
  later one forces it: every child gets SIGKILL, the temporary directories
  are removed and the process exits with status 1 at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from types import FrameType


class Interrupted(Exception):
    """SIGTERM or SIGINT while ``pagedkv serve`` started (the children are stopped)."""


# Run by the child's own interpreter before it becomes the command (exec
# keeps the death signal): no preexec_fn, so nothing runs between fork and
# exec in a process whose other threads may hold locks (gRPC's do).
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_parent(command: list[str]) -> list[str]:
    """``command`` run so that it gets SIGKILL when this process's thread
    that starts it ends (Linux's ``prctl(PR_SET_PDEATHSIG)``, kept across
    exec), SIGKILL of this process included; elsewhere ``command`` as it is
    run. Start it from the main thread (a thread's end would kill it)."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


_REAPER = """
import shutil, sys
paths = [line.rstrip("\\n") for line in sys.stdin]
for path in paths:
    shutil.rmtree(path, ignore_errors=True)
"""


class Reaper:
    """Removes ``add``ed directories after this process ends, SIGKILL
    included. ``close`` (a clean exit) lets it remove them now and waits."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _REAPER],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a signal to serve's process group spares it
        )

    def add(self, path: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(path + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class StopSignals:
    """SIGTERM and SIGINT while installed (see the module docstring).

    The first signal calls ``on_first``: by default it raises Interrupted
    (start-up: what started is stopped); ``serving`` replaces it with the
    clean stop of a running scheduler, ``stopping`` makes every signal force.
    ``force`` must kill without waiting long: it runs in the signal handler.
    """

    def __init__(self, force: Callable[[], None]) -> None:
        self.force = force
        self.num_signals = 0  # received
        self._forcing = False  # every signal forces the stop
        self.on_first: Callable[[], None] = self._interrupt
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def serving(self, stop: Callable[[], None]) -> None:
        """From now on the first signal calls ``stop`` (thread-safe)."""
        self.on_first = stop

    def stopping(self) -> None:
        """The stop is under way: any signal from now on forces it."""
        self._forcing = True

    @staticmethod
    def _interrupt() -> None:
        raise Interrupted

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.num_signals += 1
        if self.num_signals == 1 and not self._forcing:
            self.on_first()
            return
        # To fd 2, not print: the handler may interrupt a write to sys.stderr,
        # and a buffered stream refuses a reentrant one (RuntimeError).
        name = signal.Signals(signum).name
        with contextlib.suppress(OSError):  # no stderr: force the stop all the same
            os.write(2, f"pagedkv serve: {name} while stopping: SIGKILL to every child\n".encode())
        try:
            self.force()
        finally:
            os._exit(1)
