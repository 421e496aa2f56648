"""``pagedkv serve``: K executor processes and a scheduler over them, in one
command. The executors are child processes (``python -m pagedkv.executor``);
the scheduler runs in this process; metadata stays in-process. Without
``--model``, a tiny random llama is made in a temporary directory first."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

from pagedkv.common.cli import ModelArgumentError, check_model_argument
from pagedkv.common.errors import ServiceError
from pagedkv.scheduler.server import config_from_args, serve_scheduler

READY = re.compile(r"executor ready on ([\w.\-]+:\d+)")
STARTUP_TIMEOUT_S = 600.0


class ExecutorProcesses:
    """Child executor processes; ``addresses`` once they all serve."""

    def __init__(self, commands: list[list[str]]) -> None:
        self.processes = [
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for command in commands
        ]
        self.addresses: list[str] = []
        ready = [threading.Event() for _ in commands]
        found: list[str | None] = [None] * len(commands)

        def read(i: int, process: subprocess.Popen[str]) -> None:
            assert process.stdout is not None
            for line in process.stdout:
                match = READY.search(line)
                if match and not ready[i].is_set():
                    found[i] = match.group(1)
                    ready[i].set()
            ready[i].set()  # the process ended

        for i, process in enumerate(self.processes):
            threading.Thread(target=read, args=(i, process), daemon=True).start()
        for event in ready:
            event.wait(STARTUP_TIMEOUT_S)
        if any(address is None for address in found):
            self.stop()
            raise RuntimeError("an executor did not start (its output is above)")
        self.addresses = [a for a in found if a is not None]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


@contextlib.contextmanager
def _model_dir(model: str | None) -> Iterator[str]:
    if model is not None:
        yield model
        return
    with tempfile.TemporaryDirectory(prefix="pagedkv-tiny-") as root:
        command = [sys.executable, "-m", "pagedkv.common.cli", "make-tiny-model", root]
        subprocess.run([*command, "--arch", "llama"], check=True, stdout=subprocess.DEVNULL)
        yield root


def executor_commands(args: argparse.Namespace, model: str) -> list[list[str]]:
    backend = args.kernel_backend or ("torch" if args.device == "cpu" else "triton")
    commands = []
    for i in range(args.executors):
        device = args.device
        if device == "cuda" and args.executors > 1:
            device = f"cuda:{i}"
        command = [sys.executable, "-m", "pagedkv.executor", "--model", model, "--port", "0"]
        command += ["--log-format", args.log_format, "--log-level", args.log_level]
        command += ["--device", device, "--kernel-backend", backend, "--dtype", args.dtype]
        command += ["--load-format", args.load_format]
        command += ["--max-num-rows", str(args.max_num_seqs)]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.num_blocks is not None:
            command += ["--num-blocks", str(args.num_blocks)]
        if args.enforce_eager:
            command.append("--enforce-eager")
        commands.append(command)
    return commands


def run_serve(args: argparse.Namespace) -> int:
    """The ``pagedkv serve`` handler: 0 after a clean stop, 1 when the
    scheduler fails, 2 for a ``--model`` that names no model (said in one
    line before any executor starts)."""
    if args.model is not None:
        try:
            check_model_argument(args.model)
        except ModelArgumentError as exc:
            print(f"pagedkv serve: --model {args.model}: {exc}", file=sys.stderr)
            return 2
    with _model_dir(args.model) as model:
        args.model = model
        executors = ExecutorProcesses(executor_commands(args, model))
        try:
            asyncio.run(
                serve_scheduler(
                    config_from_args(args, executors.addresses),
                    args.host,
                    args.port,
                    args.metrics_port,
                    ready_line="pagedkv serve",
                )
            )
        except ServiceError as exc:
            print(f"pagedkv serve: {exc}", file=sys.stderr)
            return 1
        finally:
            executors.stop()
    return 0
