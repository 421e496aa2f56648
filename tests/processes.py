"""A server process on 127.0.0.1 that prints ``... ready on HOST:PORT``: the
executor, ``pagedkv serve`` and ``pagedkv scheduler`` all do."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading

import grpc

READY = re.compile(r"ready on ([\d.]+):(\d+)")


class ServedProcess:
    """Starts ``command``, waits for its readiness line and opens a channel to
    it (``target``, ``channel``, ``ready_line``); stderr is kept for errors.
    A context manager: closing terminates the process."""

    def __init__(self, command: list[str], timeout: float = 300.0) -> None:
        self.channel: grpc.Channel | None = None
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        ready = threading.Event()
        lines: list[str] = []
        self.lines = lines  # every stdout line so far (the reader keeps adding)

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                lines.append(line)
                if READY.search(line):
                    ready.set()
            ready.set()  # the process ended

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        self.ready_line = next((line for line in lines if READY.search(line)), "")
        match = READY.search(self.ready_line)
        if match is None:
            self.log.seek(0)
            errors = self.log.read()[-4000:]
            self.close()
            raise RuntimeError(f"{command[2:4]} did not start: {lines} {errors}")
        self.target = f"{match.group(1)}:{match.group(2)}"
        self.channel = grpc.insecure_channel(self.target)

    def stderr(self) -> str:
        """What the process has written to stderr so far (read without moving
        the file offset the process writes at)."""
        fd = self.log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def __enter__(self) -> ServedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
