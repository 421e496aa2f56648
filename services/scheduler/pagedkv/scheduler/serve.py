"""``pagedkv serve``: K executor processes and schedulers over them, in one
command. The executors are child processes (``python -m pagedkv.executor``);
one scheduler runs in this process. Without ``--model``, a tiny random llama
is made in a temporary directory first.

Without Redis, metadata stays in-process: the scheduler takes the executors
over by address. With ``--redis-url URL``, or ``--redis`` (a private
``redis-server`` for this command), they form a cluster (docs/cluster.md):
the executors register, the scheduler here joins and claims them, then
``--schedulers N`` starts N-1 ``pagedkv scheduler --redis-url`` children,
which take their share (the members balance by draining). One ready line per
scheduler: this process's once it has claimed its executors, the others once
every registered executor is leased to a live member and none holds two more
than another. ``--routers R`` then starts R ``pagedkv router`` children on
``--port``.. (the schedulers' ports follow theirs), one ready line each.
Every child (and the private Redis) is stopped on exit: SIGTERM, then
SIGKILL after a grace."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import Any, NamedTuple, NoReturn, TypeVar

import redis
import redis.asyncio

from pagedkv.cluster.connection import check_redis_url, connect, connect_sync, redacted
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import Lease, LeaseTable
from pagedkv.cluster.members import MemberRecord, Members
from pagedkv.cluster.registry import ExecutorRecord, list_executors
from pagedkv.common.cli import ModelArgumentError, check_model_argument
from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.server import config_from_args, serve_scheduler

READY = re.compile(r"executor ready on ([\w.\-]+:\d+)")
SCHEDULER_READY = re.compile(r"scheduler ready on ([\w.\-]+:\d+)")
ROUTER_READY = re.compile(r"router ready on ([\w.\-]+:\d+)")
STARTUP_TIMEOUT_S = 600.0
REGISTER_TIMEOUT_S = 60.0  # executors in the registry, once they are ready
SETTLE_TIMEOUT_S = 60.0  # the cluster's executors all leased and balanced
STOP_GRACE_S = 20.0

T = TypeVar("T")
log = get_logger(__name__)


class StartError(Exception):
    """A child exited, or did not say it was ready in time, while ``pagedkv
    serve`` started (or Redis did not answer); the message is one line."""


class Interrupted(Exception):
    """SIGTERM while ``pagedkv serve`` started (the children are stopped)."""


class ChildProcesses:
    """Child processes that each print a ready line with their address.

    Start-up is reported on this process's log, one ``<what> ready`` line per
    child (``<what>=LABEL``, its address and seconds since start).
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
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for command in commands
        ]
        self.addresses: list[str] = []
        self.details: dict[int, str] = {}  # child -> the rest of its ready line
        self._outcomes: queue.Queue[tuple[int, str | None]] = queue.Queue()
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
        while len(found) < num:
            try:
                i, address = self._outcomes.get(timeout=max(deadline - time.perf_counter(), 0))
            except queue.Empty:
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

    def stop(self) -> None:
        """SIGTERM to every child still running; SIGKILL to those still
        running ``grace`` seconds later."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
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
    temporary directory, without persistence; ``url`` once it answers PING."""

    def __init__(self, binary: str, timeout: float = 30.0) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{port}/0"
        self.dir = tempfile.mkdtemp(prefix="pagedkv-redis-")
        command = [binary, "--port", str(port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", self.dir]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
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
        log.info("private redis ready", url=self.url)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


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
        commands.append(command)
    return commands


class ClusterView(NamedTuple):
    """The registry, the live members and the leases, read at one moment."""

    executors: list[ExecutorRecord]
    members: list[MemberRecord]
    leases: dict[str, Lease]

    @classmethod
    async def read(cls, client: redis.asyncio.Redis, keys: Keys) -> ClusterView:
        executors = await list_executors(client, keys)
        members = await Members(client, keys).live()
        leases = await LeaseTable(client, keys).read([r.address for r in executors])
        return cls(executors, members, leases)

    def held(self) -> dict[str, int]:
        """Member address -> how many executors it holds."""
        owners = {m.member_id: m.address for m in self.members}
        counts = dict.fromkeys(owners.values(), 0)
        for lease in self.leases.values():
            if lease.owner_id in owners:
                counts[owners[lease.owner_id]] += 1
        return counts

    def settled(self, member_addresses: Collection[str] = ()) -> bool:
        """Every registered executor is leased to a live member, no member
        holds two more than another, and ``member_addresses`` are all live."""
        live = {m.member_id for m in self.members}
        if not live or not set(member_addresses) <= {m.address for m in self.members}:
            return False
        if any(self.leases.get(r.address, _NO_LEASE).owner_id not in live for r in self.executors):
            return False
        counts = self.held().values()
        return max(counts) - min(counts) <= 1


_NO_LEASE = Lease("", "", 0, "")


async def _wait_for(
    client: redis.asyncio.Redis, condition: Callable[[ClusterView], bool], timeout: float
) -> ClusterView | None:
    """The first view that meets ``condition``, polled; None after ``timeout``."""
    deadline = time.monotonic() + timeout
    keys = Keys()
    while True:
        view = await ClusterView.read(client, keys)
        if condition(view):
            return view
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.1)


async def _unless_stopped(scheduler: asyncio.Future[None], work: Awaitable[T]) -> T:
    """``work``'s result; raises Interrupted (or the scheduler's error) when
    the scheduler here ends first (SIGTERM during start-up)."""
    job = asyncio.ensure_future(work)
    pending: list[asyncio.Future[Any]] = [scheduler, job]
    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    if job.done():
        return job.result()
    job.cancel()
    await scheduler
    raise Interrupted


async def _serve_cluster(
    args: argparse.Namespace, executors: list[str], redis_url: str, model: str
) -> None:
    """Waits for the executors in the registry, serves the scheduler here as
    a member, then starts the child schedulers and prints their ready lines
    once the cluster is settled (see the module docstring); returns when the
    scheduler here stops (SIGTERM or SIGINT)."""
    client = connect(redis_url)
    children: ChildProcesses | None = None
    routers: ChildProcesses | None = None
    num = args.schedulers
    port = args.port + args.routers if args.port else 0
    metrics_port = args.metrics_port
    if metrics_port:
        metrics_port += args.routers
    try:
        registered = await _wait_for(
            client,
            lambda view: set(executors) <= {r.address for r in view.executors},
            REGISTER_TIMEOUT_S,
        )
        if registered is None:
            raise StartError(f"executors not registered at {redacted(redis_url)} in time")
        label = "pagedkv serve" if num == 1 else f"pagedkv serve scheduler 1/{num}"
        config = config_from_args(args, [], port=port)
        scheduler = asyncio.ensure_future(
            serve_scheduler(
                config,
                args.host,
                port,
                metrics_port,
                ready_line=label,
                drain_timeout=args.drain_timeout,
            )
        )
        if num > 1:
            await _unless_stopped(
                scheduler, _wait_for(client, ClusterView.settled, SETTLE_TIMEOUT_S)
            )
            labels = [f"{i + 1}/{num}" for i in range(1, num)]
            grace = args.drain_timeout + STOP_GRACE_S
            commands = scheduler_commands(args, model, redis_url)
            children = ChildProcesses(commands, "scheduler", SCHEDULER_READY, labels, grace)
            addresses = await _unless_stopped(scheduler, asyncio.to_thread(children.wait_ready))
            settled = await _unless_stopped(
                scheduler,
                _wait_for(client, lambda view: view.settled(addresses), SETTLE_TIMEOUT_S),
            )
            if settled is None:
                log.warning("executors not balanced over the schedulers in time")
            view = settled or await ClusterView.read(client, Keys())
            held = view.held()
            for label, address in zip(labels, addresses, strict=True):
                print(
                    f"pagedkv serve scheduler {label} ready on {address} "
                    f"({held.get(address, 0)} executors, model {model})",
                    flush=True,
                )
        if args.routers:
            labels = [f"{i + 1}/{args.routers}" for i in range(args.routers)]
            commands = router_commands(args, model, redis_url)
            grace = args.drain_timeout + STOP_GRACE_S
            routers = ChildProcesses(commands, "router", ROUTER_READY, labels, grace)
            addresses = await _unless_stopped(scheduler, asyncio.to_thread(routers.wait_ready))
            for i, (label, address) in enumerate(zip(labels, addresses, strict=True)):
                details = routers.details.get(i, "")
                print(f"pagedkv serve router {label} ready on {address} {details}", flush=True)
        await scheduler
    finally:
        if routers is not None:
            await asyncio.to_thread(routers.stop)
        if children is not None:
            await asyncio.to_thread(children.stop)
        await client.aclose()


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise Interrupted


def run_serve(args: argparse.Namespace) -> int:
    """The ``pagedkv serve`` handler: 0 after a clean stop, 1 when a child
    does not start or a scheduler fails, 2 for wrong arguments (a ``--model``
    that names no model, ``--schedulers`` over 1 without Redis, ``--redis``
    without ``redis-server``), said in one line before any child starts."""
    problem = _check_arguments(args)
    if problem is not None:
        print(f"pagedkv serve: {problem}", file=sys.stderr)
        return 2
    # Until the scheduler here serves (its handler replaces this one), a
    # SIGTERM stops what has started.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    private: PrivateRedis | None = None
    executors: ExecutorProcesses | None = None
    try:
        with _model_dir(args.model) as model:
            args.model = model
            if args.redis:
                private = PrivateRedis(shutil.which("redis-server") or "redis-server")
                args.redis_url = private.url
            log.info(
                "starting executors", num_executors=args.executors, model=model, device=args.device
            )
            commands = executor_commands(args, model)
            if args.redis_url:
                commands = [[*command, "--redis-url", args.redis_url] for command in commands]
            executors = ExecutorProcesses(commands)
            if args.redis_url:
                asyncio.run(_serve_cluster(args, executors.addresses, args.redis_url, model))
            else:
                asyncio.run(
                    serve_scheduler(
                        config_from_args(args, executors.addresses),
                        args.host,
                        args.port,
                        args.metrics_port,
                        ready_line="pagedkv serve",
                        drain_timeout=args.drain_timeout,
                    )
                )
    except (StartError, ServiceError) as exc:
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"pagedkv serve: redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        return 1
    except Interrupted:
        print("pagedkv serve: stopped before it was ready", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the children's stop is bounded
        if executors is not None:
            executors.stop()
        if private is not None:
            private.stop()
        signal.signal(signal.SIGTERM, previous)
    return 0


def _check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line; None when nothing is."""
    if args.model is not None:
        try:
            check_model_argument(args.model)
        except ModelArgumentError as exc:
            return f"--model {args.model}: {exc}"
    if args.redis and args.redis_url:
        return "give --redis (a private redis-server) or --redis-url URL, not both"
    if args.schedulers < 1:
        return f"--schedulers {args.schedulers}: at least 1"
    if args.routers < 0:
        return f"--routers {args.routers}: at least 0"
    if args.routers and not (args.redis or args.redis_url):
        return (
            f"--routers {args.routers} needs a cluster: give --redis-url URL "
            "or --redis (a private redis-server)"
        )
    if args.router_weights:
        try:
            weights = [float(w) for w in args.router_weights.split(",")]
        except ValueError:
            weights = []
        if (
            not 3 <= len(weights) <= 5
            or not all(w >= 0 for w in weights[:3] + weights[4:])
            or not all(b >= 1 for b in weights[3:4])
        ):
            return (
                f"--router-weights {args.router_weights}: three weights >= 0, then optionally "
                "a load bound >= 1 and a load slack >= 0, PREFIX,LOAD,KV[,BOUND[,SLACK]]"
            )
    if args.schedulers > 1 and not (args.redis or args.redis_url):
        return (
            f"--schedulers {args.schedulers} needs a cluster: give --redis-url URL "
            "or --redis (a private redis-server)"
        )
    if args.redis and shutil.which("redis-server") is None:
        return "--redis: redis-server is not installed (not on PATH; `make redis` installs it)"
    if args.redis_url:
        try:
            check_redis_url(args.redis_url)
        except ValueError as exc:
            return f"--redis-url: {exc}"
    return None
