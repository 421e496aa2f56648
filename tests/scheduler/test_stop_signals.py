"""``pagedkv serve``'s stop signals: a second one forces the stop even when
it arrives in the middle of a write to stderr (a buffered stream refuses a
reentrant write, so the handler must not print)."""

from __future__ import annotations

import subprocess
import sys

FORCED_DURING_A_WRITE = """
import os, signal, sys
from pagedkv.scheduler.lifetime import StopSignals

class InTheMiddleOfAWrite:
    # what sys.stderr says when a signal handler writes while it is writing
    def write(self, text):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")
    def flush(self):
        pass

signals = StopSignals(lambda: os.write(1, b"forced\\n"))
signals.install()
signals.stopping()
sys.stderr = InTheMiddleOfAWrite()
os.kill(os.getpid(), signal.SIGTERM)
print("not forced", flush=True)
"""


def test_a_signal_during_the_stop_forces_it_even_in_the_middle_of_a_write() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORCED_DURING_A_WRITE], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (1, "forced\n")
    assert done.stderr == "pagedkv serve: SIGTERM while stopping: SIGKILL to every child\n"
