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
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, NamedTuple, NoReturn, TypeVar

import redis
import redis.asyncio

from pagedkv.cluster.connection import check_redis_url, connect, redacted
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.leases import Lease, LeaseTable
from pagedkv.cluster.members import MemberRecord, Members
from pagedkv.cluster.registry import ExecutorRecord, list_executors
from pagedkv.common.cli import ModelArgumentError, check_model_argument
from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.common.ports import ListenError, check_free
from pagedkv.scheduler.children import (
    ROUTER_READY,
    SCHEDULER_READY,
    STOP_GRACE_S,
    ChildProcesses,
    ExecutorProcesses,
    Interrupted,
    PrivateRedis,
    StartError,
    executor_commands,
    model_dir,
    router_commands,
    scheduler_commands,
)
from pagedkv.scheduler.server import config_from_args, serve_scheduler

REGISTER_TIMEOUT_S = 60.0  # executors in the registry, once they are ready
SETTLE_TIMEOUT_S = 60.0  # the cluster's executors all leased and balanced

T = TypeVar("T")
log = get_logger(__name__)


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
        with model_dir(args.model) as model:
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
    except ListenError as exc:  # taken since the check, by a race
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
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
    return _port_in_use(args)


def _port_in_use(args: argparse.Namespace) -> str | None:
    """The first port this command's servers would listen on that another
    process holds, in one line: ``--port``.. (the routers', then the
    schedulers'), the metrics and health ports likewise; None when none is."""
    num = args.routers + args.schedulers
    bases = {
        "--port": args.port,
        "--metrics-port": args.metrics_port,
        "--health-port": getattr(args, "health_port", None),
    }
    for flag, base in bases.items():
        for port in range(base, base + num) if base else ():
            try:
                check_free(flag, args.host, port)
            except ListenError as exc:
                return str(exc)
    return None
