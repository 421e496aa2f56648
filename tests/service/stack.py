"""Real processes for the service tests: ``pagedkv serve`` (executors and a
scheduler) or ``pagedkv scheduler`` over given executors, on 127.0.0.1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import grpc

from pagedkv.v1 import scheduler_pb2_grpc

READY = re.compile(r"ready on ([\d.]+):(\d+)")


class Process:
    """A ``pagedkv`` subcommand that prints a readiness line; a context manager."""

    def __init__(self, args: list[str], timeout: float = 300.0) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.common.cli", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        ready = threading.Event()
        lines: list[str] = []

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                lines.append(line)
                if READY.search(line):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        match = READY.search("".join(lines))
        self.ready_line = next((line for line in lines if READY.search(line)), "")
        if match is None:
            self.log.seek(0)
            errors = self.log.read()[-4000:]
            self.close()
            raise RuntimeError(f"{args[0]} did not start: {lines} {errors}")
        self.target = f"{match.group(1)}:{match.group(2)}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(model_dir: Path, *, executors: int = 1, num_blocks: int = 256, extra=()) -> Process:
    return Process(
        [
            "serve",
            "--model",
            str(model_dir),
            "--executors",
            str(executors),
            "--num-blocks",
            str(num_blocks),
            "--port",
            "0",
            *extra,
        ]
    )
