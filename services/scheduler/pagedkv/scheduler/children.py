"""The child processes of ``pagedkv serve`` (and of the benchmarks that start
the same stack): executors, schedulers and routers that each print a ready
line with their address, a private ``redis-server``, and the model directory.
The command lines the children run with are child_commands.py's."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import redis

from pagedkv.cluster.connection import connect_sync
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.lifetime import Reaper, dying_with_parent

READY = re.compile(r"executor ready on ([\w.\-]+:\d+)")
SCHEDULER_READY = re.compile(r"scheduler ready on ([\w.\-]+:\d+)")
ROUTER_READY = re.compile(r"router ready on ([\w.\-]+:\d+)")
GATEWAY_READY = re.compile(r"gateway ready on ([\w.\-]+:\d+)")
STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 20.0
PROGRESS_INTERVAL_S = 10.0  # a line while children start, this often

log = get_logger(__name__)


class StartError(Exception):
    """A child exited, or did not say it was ready in time, while ``pagedkv
    serve`` started (or Redis did not answer); the message is one line."""


class ChildProcesses:
    """Child processes that each print a ready line with their address.

    Start-up is reported on this process's log: one ``<what> starting``
    line per child (``<what>=LABEL``, its pid), every
    ``PROGRESS_INTERVAL_S`` while some are not ready a ``<what>s starting``
    line naming them (and the seconds since start), and one ``<what> ready``
    line per child (its address and seconds since start).
    ``wait_ready`` returns the addresses in order; the first child to exit
    before it is ready stops them all: ``StartError``. ``stop`` may be called
    from any thread (it makes a pending ``wait_ready`` raise).
    """

    def __init__(
        self,
        commands: list[list[str]],
        what: str,
        ready: re.Pattern[str],
        labels: list[str],
        grace: float = STOP_GRACE_S,
    ) -> None:
        self.what, self.labels, self.grace = what, labels, grace
        self.start = time.perf_counter()
        self.processes = [
            subprocess.Popen(dying_with_parent(command), stdout=subprocess.PIPE, text=True)
            for command in commands
        ]
        self.addresses: list[str] = []
        self.details: dict[int, str] = {}  # child -> the rest of its ready line
        self._outcomes: queue.Queue[tuple[int, str | None]] = queue.Queue()
        for label, process in zip(labels, self.processes, strict=True):
            log.info(f"{what} starting", **{what: label, "pid": process.pid})
        for i, process in enumerate(self.processes):
            threading.Thread(target=self._read, args=(i, process, ready), daemon=True).start()

    def _read(self, i: int, process: subprocess.Popen[str], ready: re.Pattern[str]) -> None:
        """Reports child ``i``'s address, or None when it ends unready; keeps
        reading its stdout until it ends."""
        assert process.stdout is not None
        address = None
        for line in process.stdout:
            match = ready.search(line)
            if match and address is None:
                address = match.group(1)
                self.details[i] = line[match.end() :].strip()
                self._outcomes.put((i, address))
        if address is None:
            self._outcomes.put((i, None))

    def wait_ready(self) -> list[str]:
        num = len(self.processes)
        found: dict[int, str] = {}
        deadline = self.start + STARTUP_TIMEOUT_S
        next_report = self.start + PROGRESS_INTERVAL_S
        while len(found) < num:
            now = time.perf_counter()
            try:
                i, address = self._outcomes.get(timeout=max(min(deadline, next_report) - now, 0))
            except queue.Empty:
                if time.perf_counter() < deadline:
                    next_report += PROGRESS_INTERVAL_S
                    waiting = [self.labels[j] for j in range(num) if j not in found]
                    log.info(
                        f"{self.what}s starting",
                        waiting=",".join(waiting),
                        seconds=round(time.perf_counter() - self.start),
                    )
                    continue
                self.stop()
                raise StartError(
                    f"{self.what}s not ready after {STARTUP_TIMEOUT_S:.0f} s: "
                    + ", ".join(self.labels[j] for j in range(num) if j not in found)
                ) from None
            if address is None:
                self.stop()
                status = self.processes[i].wait()
                raise StartError(
                    f"{self.what} {self.labels[i]} exited with status {status} before it was "
                    "ready (its log is above)"
                )
            found[i] = address
            seconds = round(time.perf_counter() - self.start, 1)
            fields = {self.what: self.labels[i], "address": address, "seconds": seconds}
            log.info(f"{self.what} ready", **fields)
        self.addresses = [found[i] for i in range(num)]
        return self.addresses

    def terminate(self) -> None:
        """SIGTERM to every child still running (returns at once)."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()

    def kill(self) -> None:
        """SIGKILL to every child still running (returns at once)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()

    def stop(self) -> None:
        """SIGTERM to every child still running; SIGKILL to those still
        running ``grace`` seconds later."""
        self.terminate()
        deadline = time.monotonic() + self.grace
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class ExecutorProcesses(ChildProcesses):
    """Child executors, all serving once constructed (``addresses``)."""

    def __init__(self, commands: list[list[str]]) -> None:
        num = len(commands)
        super().__init__(commands, "executor", READY, [f"{i + 1}/{num}" for i in range(num)])
        try:
            self.wait_ready()
        except BaseException:  # Interrupted or KeyboardInterrupt too: no child left
            self.stop()
            raise


class PrivateRedis:
    """``--redis``: a ``redis-server`` on a free port of 127.0.0.1 in a
    temporary directory (mode 0700), without persistence, ready once it
    answers PING.

    With ``password``, it requires a generated one, kept in
    ``password_file`` (mode 0600, for ``--redis-password-file``) and in its
    configuration file beside it, never on a command line. ``url`` carries
    the password (for this process's clients; log it only ``redacted``);
    ``public_url`` does not (for the children's command lines). ``reaper``
    gets the directory before anything is written there, so that it goes
    even if this process is killed while the server starts."""

    def __init__(
        self,
        binary: str,
        timeout: float = 30.0,
        password: bool = False,
        reaper: Reaper | None = None,
    ) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.public_url = self.url = f"redis://127.0.0.1:{port}/0"
        self.dir = tempfile.mkdtemp(prefix="pagedkv-redis-")
        if reaper is not None:
            reaper.add(self.dir)
        self.password_file: str | None = None
        command = [binary]
        if password:
            secret = secrets.token_urlsafe(32)
            self.password_file = _private_file(self.dir, "password", secret + "\n")
            command.append(_private_file(self.dir, "redis.conf", f"requirepass {secret}\n"))
            self.url = f"redis://:{secret}@127.0.0.1:{port}/0"
        command += ["--port", str(port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", self.dir]
        self.process = subprocess.Popen(dying_with_parent(command), stdout=subprocess.DEVNULL)
        client = connect_sync(self.url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise StartError(f"redis-server on port {port} did not start") from None
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()
        log.info("private redis ready", url=self.public_url, password=password)

    def kill(self) -> None:
        """SIGKILL to the server (returns at once)."""
        if self.process.poll() is None:
            self.process.kill()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _private_file(directory: str, name: str, content: str) -> str:
    """``content`` in a new file ``name`` of ``directory`` that only this
    user can read (created with mode 0600); its path."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(content)
    return path


@contextlib.contextmanager
def model_dir(model: str | None, reaper: Reaper | None = None) -> Iterator[str]:
    """``model``, or without one a tiny random llama made in a temporary
    directory (removed on exit; by ``reaper`` too, should this process be
    killed)."""
    if model is not None:
        yield model
        return
    with tempfile.TemporaryDirectory(prefix="pagedkv-tiny-") as root:
        if reaper is not None:
            reaper.add(root)
        command = [sys.executable, "-m", "pagedkv.common.cli", "make-tiny-model", root]
        command = dying_with_parent([*command, "--arch", "llama"])
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        yield root
