"""The child processes of ``pagedkv serve`` (and of the benchmarks that start
the same stack): executors, schedulers and routers that each print a ready
line with their address, a private ``redis-server``, the model directory, and
the command lines the children run with."""

from __future__ import annotations

import argparse
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
        for flag, value in (
            ("--gpu-memory-utilization", getattr(args, "gpu_memory_utilization", None)),
            ("--max-model-len", getattr(args, "max_model_len", None)),
        ):
            if value is not None:
                command += [flag, str(value)]
        if args.enforce_eager:
            command.append("--enforce-eager")
        if getattr(args, "redis_url", None):
            command += ["--redis-url", args.redis_url, *_redis_secrets(args)]
        commands.append(command)
    return commands


def _redis_secrets(args: argparse.Namespace) -> list[str]:
    """``--redis-password-file`` and ``--redis-tls-ca``, as given (or, for
    ``--redis``, the private Redis' password file)."""
    options = []
    for flag in ("--redis-password-file", "--redis-tls-ca"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            options += [flag, value]
    return options


def _server_security(args: argparse.Namespace, health_port: int | None) -> list[str]:
    """The TLS and token options of a child serving the client-facing API,
    as ``pagedkv serve`` has them; ``--health-port`` ``health_port``."""
    options = []
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--auth-token-file"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            options += [flag, value]
    if health_port is not None:
        options += ["--health-port", str(health_port)]
    return options


def scheduler_commands(args: argparse.Namespace, model: str, redis_url: str) -> list[list[str]]:
    """The ``--schedulers N`` - 1 child schedulers: this command's scheduler
    options, ports after this one's (any free port when ``--port`` is 0),
    metrics ports likewise."""
    commands = []
    base = args.port + args.routers if args.port else 0
    for i in range(1, args.schedulers):
        command = [sys.executable, "-m", "pagedkv.common.cli"]
        command += ["--log-format", args.log_format, "--log-level", args.log_level, "scheduler"]
        command += ["--redis-url", redis_url, "--lease-ttl", str(args.lease_ttl), "--model", model]
        command += ["--host", args.host, "--port", str(base + i if base else 0)]
        command += ["--max-num-seqs", str(args.max_num_seqs)]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        command += ["--decode-window", str(args.decode_window)]
        command += ["--pipeline-depth", str(args.pipeline_depth)]
        command += ["--stream-pace-us", str(args.stream_pace_us)]
        command += ["--executor-timeout", str(args.executor_timeout)]
        command += ["--drain-timeout", str(args.drain_timeout)]
        if args.metrics_port is not None:
            port = args.metrics_port + args.routers + i if args.metrics_port else 0
            command += ["--metrics-port", str(port)]
        command += _redis_secrets(args)
        health_port = getattr(args, "health_port", None)
        command += _server_security(args, health_port and health_port + args.routers + i)
        commands.append(command)
    return commands


def router_commands(args: argparse.Namespace, model: str, redis_url: str) -> list[list[str]]:
    """The ``--routers R`` routers: ports ``--port``.. (the schedulers' come
    after), metrics ports likewise."""
    commands = []
    for i in range(args.routers):
        command = [sys.executable, "-m", "pagedkv.common.cli"]
        command += ["--log-format", args.log_format, "--log-level", args.log_level, "router"]
        command += ["--redis-url", redis_url, "--model", model, "--policy", args.router_policy]
        command += ["--host", args.host, "--port", str(args.port + i if args.port else 0)]
        command += ["--drain-timeout", str(args.drain_timeout)]
        if args.router_weights:
            values = args.router_weights.split(",")
            flags = (
                "--weight-prefix",
                "--weight-load",
                "--weight-kv",
                "--load-bound",
                "--load-slack",
            )
            for flag, value in zip(flags, values, strict=False):
                command += [flag, value]
        if args.metrics_port is not None:
            port = args.metrics_port + i if args.metrics_port else 0
            command += ["--metrics-port", str(port)]
        command += _redis_secrets(args)
        health_port = getattr(args, "health_port", None)
        command += _server_security(args, health_port and health_port + i)
        for flag in ("--scheduler-tls-ca", "--scheduler-tls-cert", "--scheduler-tls-key"):
            value = getattr(args, flag[2:].replace("-", "_"), None)
            if value is not None:
                command += [flag, value]
        if getattr(args, "scheduler_tls_server_name", None):
            command += ["--scheduler-tls-server-name", args.scheduler_tls_server_name]
        if getattr(args, "auth_token_file", None):  # its first token opens the schedulers
            command += ["--scheduler-token-file", args.auth_token_file]
        commands.append(command)
    return commands


def gateway_command(args: argparse.Namespace, model: str, targets: list[str]) -> list[str]:
    """``--http-port``'s gateway in front of ``targets`` (the routers, or
    every scheduler): on ``--host``, with the stack's tokens (the file's
    first token opens the targets too) and, towards a TLS stack, the
    ``--scheduler-tls-*`` material the routers use."""
    command = [sys.executable, "-m", "pagedkv.common.cli"]
    command += ["--log-format", args.log_format, "--log-level", args.log_level, "gateway"]
    command += ["--target", ",".join(targets), "--model", model]
    command += ["--host", args.host, "--port", str(args.http_port)]
    command += ["--drain-timeout", str(args.drain_timeout)]
    if getattr(args, "served_model_name", None):
        command += ["--served-model-name", args.served_model_name]
    if getattr(args, "auth_token_file", None):
        command += ["--auth-token-file", args.auth_token_file, "--token-file", args.auth_token_file]
    for flag in ("tls-ca", "tls-cert", "tls-key", "tls-server-name"):
        value = getattr(args, f"scheduler_{flag.replace('-', '_')}", None)
        if value is not None:
            command += [f"--{flag}", value]
    return command
