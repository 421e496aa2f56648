"""Real processes for the service tests: ``pagedkv serve`` (executors and a
scheduler) or ``pagedkv scheduler`` over given executors, on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

from pagedkv.v1 import scheduler_pb2_grpc
from tests.processes import ServedProcess


class Process(ServedProcess):
    """A ``pagedkv`` subcommand serving the Scheduler API; ``stub`` is its stub."""

    def __init__(self, args: list[str], timeout: float = 300.0) -> None:
        super().__init__([sys.executable, "-m", "pagedkv.common.cli", *args], timeout)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)


def serve(
    model_dir: Path,
    *,
    executors: int = 1,
    num_blocks: int = 256,
    extra=(),
    log_format: str = "console",
) -> Process:
    return Process(
        [
            "--log-format",
            log_format,
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
