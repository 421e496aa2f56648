"""``pagedkv serve``: K executor processes and a scheduler over them, in one
command. The executors are child processes (``python -m pagedkv.executor``);
the scheduler runs in this process; metadata stays in-process. Without
``--model``, a tiny random llama is made in a temporary directory first."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

from pagedkv.common.cli import ModelArgumentError, check_model_argument
from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.server import config_from_args, serve_scheduler

READY = re.compile(r"executor ready on ([\w.\-]+:\d+)")
STARTUP_TIMEOUT_S = 600.0

log = get_logger(__name__)


class ExecutorStartError(Exception):
    """An executor exited, or did not say it was ready in time, while
    ``pagedkv serve`` started; the message is one line."""


class ExecutorProcesses:
    """Child executor processes; ``addresses`` once they all serve.

    Start-up is reported on this process's log, one ``executor ready`` line
    per executor (``executor=I/K``, its address and seconds since start),
    since the executors run without progress bars. The first executor to
    exit before it is ready stops them all: ``ExecutorStartError``.
    """

    def __init__(self, commands: list[list[str]]) -> None:
        num = len(commands)
        start = time.perf_counter()
        self.processes = [
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for command in commands
        ]
        self.addresses: list[str] = []
        outcomes: queue.Queue[tuple[int, str | None]] = queue.Queue()

        def read(i: int, process: subprocess.Popen[str]) -> None:
            """Reports executor ``i``'s address, or None when it ends unready;
            keeps reading its stdout until it ends."""
            assert process.stdout is not None
            address = None
            for line in process.stdout:
                match = READY.search(line)
                if match and address is None:
                    address = match.group(1)
                    outcomes.put((i, address))
            if address is None:
                outcomes.put((i, None))

        for i, process in enumerate(self.processes):
            threading.Thread(target=read, args=(i, process), daemon=True).start()
        found: dict[int, str] = {}
        deadline = start + STARTUP_TIMEOUT_S
        while len(found) < num:
            try:
                i, address = outcomes.get(timeout=max(deadline - time.perf_counter(), 0))
            except queue.Empty:
                self.stop()
                raise ExecutorStartError(
                    f"executors not ready after {STARTUP_TIMEOUT_S:.0f} s: "
                    + ", ".join(f"{j + 1}/{num}" for j in range(num) if j not in found)
                ) from None
            if address is None:
                self.stop()
                status = self.processes[i].wait()
                raise ExecutorStartError(
                    f"executor {i + 1}/{num} exited with status {status} before it was ready "
                    "(its log is above)"
                )
            found[i] = address
            seconds = round(time.perf_counter() - start, 1)
            log.info("executor ready", executor=f"{i + 1}/{num}", address=address, seconds=seconds)
        self.addresses = [found[i] for i in range(num)]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


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
        command += ["--load-format", args.load_format, "--no-progress"]
        command += ["--max-num-rows", str(args.max_num_seqs)]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.num_blocks is not None:
            command += ["--num-blocks", str(args.num_blocks)]
        if args.enforce_eager:
            command.append("--enforce-eager")
        commands.append(command)
    return commands


def run_serve(args: argparse.Namespace) -> int:
    """The ``pagedkv serve`` handler: 0 after a clean stop, 1 when an
    executor does not start or the scheduler fails, 2 for a ``--model`` that
    names no model (said in one line before any executor starts)."""
    if args.model is not None:
        try:
            check_model_argument(args.model)
        except ModelArgumentError as exc:
            print(f"pagedkv serve: --model {args.model}: {exc}", file=sys.stderr)
            return 2
    with _model_dir(args.model) as model:
        args.model = model
        log.info(
            "starting executors", num_executors=args.executors, model=model, device=args.device
        )
        try:
            executors = ExecutorProcesses(executor_commands(args, model))
        except ExecutorStartError as exc:
            print(f"pagedkv serve: {exc}", file=sys.stderr)
            return 1
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
