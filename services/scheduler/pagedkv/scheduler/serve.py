"""``pagedkv serve``: K executor processes and schedulers over them, in one
command. The executors are child processes (``python -m pagedkv.executor``);
one scheduler runs in this process. Without a model (``MODEL`` or
``--model``), a tiny random llama is made in a temporary directory first.

Without Redis, metadata stays in-process: the scheduler takes the executors
over by address. With ``--redis-url URL``, or ``--redis`` (a private
``redis-server`` for this command, with a generated password), they form a
cluster (docs/cluster.md):
the executors register, the scheduler here joins and claims them, then
``--schedulers N`` starts N-1 ``pagedkv scheduler --redis-url`` children,
which take their share (the members balance by draining). With one
scheduler, its ready line once it has claimed its executors; with more, one
line per scheduler once every registered executor is leased to a live member
and none holds two more than another, each counting what it holds then.
``--routers R`` then starts R ``pagedkv router`` children on ``--port``..
(the schedulers' ports follow theirs), one ready line each.

Every child (and the private Redis) is stopped on exit: SIGTERM, then
SIGKILL after a grace; a second signal forces the stop, and the children
die with this process however it ends (``lifetime``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis
import redis.asyncio

from pagedkv.cluster.connection import connect, redacted, redis_url_with
from pagedkv.cluster.keys import Keys
from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.common.ports import ListenError
from pagedkv.common.server_security import server_security_from_args
from pagedkv.scheduler.child_commands import (
    executor_commands,
    gateway_command,
    router_commands,
    scheduler_commands,
)
from pagedkv.scheduler.children import (
    GATEWAY_READY,
    ROUTER_READY,
    SCHEDULER_READY,
    STOP_GRACE_S,
    ChildProcesses,
    ExecutorProcesses,
    PrivateRedis,
    StartError,
    model_dir,
)
from pagedkv.scheduler.cluster_settling import ClusterView, wait_for
from pagedkv.scheduler.lifetime import Interrupted, StopSignals
from pagedkv.scheduler.serve_arguments import check_arguments
from pagedkv.scheduler.serve_stack import Stack
from pagedkv.scheduler.server import config_from_args, serve_scheduler

REGISTER_TIMEOUT_S = 60.0  # executors in the registry, once they are ready
SETTLE_TIMEOUT_S = 60.0  # the cluster's executors all leased and balanced

T = TypeVar("T")
log = get_logger(__name__)


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


async def _start_gateway(
    args: argparse.Namespace,
    model: str,
    targets: list[str],
    stack: Stack,
    scheduler: asyncio.Future[None],
) -> None:
    """Starts ``--http-port``'s gateway in front of ``targets`` (stopped with
    the other servers of ``stack``) and prints its ready line once it serves."""
    grace = args.drain_timeout + STOP_GRACE_S
    command = gateway_command(args, model, targets)
    gateway = ChildProcesses([command], "gateway", GATEWAY_READY, ["1/1"], grace)
    stack.servers.append(gateway)
    (address,) = await _unless_stopped(scheduler, asyncio.to_thread(gateway.wait_ready))
    details = gateway.details.get(0, "")
    print(f"pagedkv serve gateway ready on {address} {details}", flush=True)


def _print_ready(address: str, num_executors: int, model: str, extra: str) -> None:
    """The scheduler's ready line, as ``serve_scheduler`` prints it."""
    print(
        f"pagedkv serve ready on {address} ({num_executors} executors, model {model}{extra})",
        flush=True,
    )


async def _serve_alone(
    args: argparse.Namespace, executors: list[str], stack: Stack, signals: StopSignals
) -> None:
    """The scheduler here over ``executors``, without Redis, until a signal;
    with ``--http-port``, its gateway once it serves."""
    here: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
    with_gateway = args.http_port is not None
    scheduler = asyncio.ensure_future(
        serve_scheduler(
            config_from_args(args, executors),
            args.host,
            args.port,
            args.metrics_port,
            ready_line="pagedkv serve",
            drain_timeout=args.drain_timeout,
            security=server_security_from_args(args, require_ca=False),
            stop=stack.stop_event,
            on_ready=(lambda *ready: here.set_result(ready)) if with_gateway else None,
        )
    )
    signals.serving(stack.stopping())
    try:
        if with_gateway:
            address, extra = await _unless_stopped(scheduler, here)
            _print_ready(address, len(executors), args.model, extra)
            await _start_gateway(args, args.model, [address], stack, scheduler)
        await scheduler
    finally:
        signals.stopping()
        stack.stop_event.set()
        for servers in stack.servers:
            servers.terminate()
        await stack.stop_servers()


async def _serve_cluster(
    args: argparse.Namespace,
    executors: list[str],
    redis_url: str,
    model: str,
    stack: Stack,
    signals: StopSignals,
) -> None:
    """Waits for the executors in the registry, serves the scheduler here as
    a member, then starts the child schedulers and prints every scheduler's
    ready line once the cluster is settled (see the module docstring);
    returns when the scheduler here stops (SIGTERM or SIGINT).
    ``redis_url`` carries the password, for this process's client alone."""
    client = connect(redis_url)
    num = args.schedulers
    port = args.port + args.routers if args.port else 0
    metrics_port = args.metrics_port
    if metrics_port:
        metrics_port += args.routers
    security = server_security_from_args(args, require_ca=False)
    if security.health_port:  # the routers' come first, like the ports
        security = dataclasses.replace(security, health_port=security.health_port + args.routers)
    try:
        registered = await wait_for(
            client,
            lambda view: set(executors) <= {r.address for r in view.executors},
            REGISTER_TIMEOUT_S,
        )
        if registered is None:
            raise StartError(f"executors not registered at {redacted(redis_url)} in time")
        here: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
        own_line = num == 1 and args.http_port is None  # else printed here, once it serves
        scheduler = asyncio.ensure_future(
            serve_scheduler(
                config_from_args(args, [], port=port),
                args.host,
                port,
                metrics_port,
                ready_line="pagedkv serve",
                drain_timeout=args.drain_timeout,
                security=security,
                stop=stack.stop_event,
                on_ready=None if own_line else lambda *ready: here.set_result(ready),
            )
        )
        signals.serving(stack.stopping())  # until now a signal interrupts the start
        targets: list[str] = []
        if num == 1 and not own_line:
            address_here, extra = await _unless_stopped(scheduler, here)
            _print_ready(address_here, len(executors), model, extra)
            targets = [address_here]
        if num > 1:
            address_here, extra = await _unless_stopped(scheduler, here)
            await _unless_stopped(
                scheduler, wait_for(client, ClusterView.settled, SETTLE_TIMEOUT_S)
            )
            labels = [f"{i + 1}/{num}" for i in range(1, num)]
            grace = args.drain_timeout + STOP_GRACE_S
            commands = scheduler_commands(args, model, args.redis_url)
            children = ChildProcesses(commands, "scheduler", SCHEDULER_READY, labels, grace)
            stack.servers.append(children)
            addresses = await _unless_stopped(scheduler, asyncio.to_thread(children.wait_ready))
            settled = await _unless_stopped(
                scheduler,
                wait_for(client, lambda view: view.settled(addresses), SETTLE_TIMEOUT_S),
            )
            if settled is None:
                log.warning("executors not balanced over the schedulers in time")
            view = settled or await ClusterView.read(client, Keys())
            held = view.held()
            member_here = args.advertise_address or address_here
            lines = [(f"1/{num}", address_here, held.get(member_here, 0), extra)]
            lines += [
                (label, address, held.get(address, 0), "")
                for label, address in zip(labels, addresses, strict=True)
            ]
            for label, address, num_held, details in lines:
                print(
                    f"pagedkv serve scheduler {label} ready on {address} "
                    f"({num_held} executors, model {model}{details})",
                    flush=True,
                )
            targets = [address_here, *addresses]
        if args.routers:
            labels = [f"{i + 1}/{args.routers}" for i in range(args.routers)]
            commands = router_commands(args, model, args.redis_url)
            grace = args.drain_timeout + STOP_GRACE_S
            routers = ChildProcesses(commands, "router", ROUTER_READY, labels, grace)
            stack.servers.append(routers)
            addresses = await _unless_stopped(scheduler, asyncio.to_thread(routers.wait_ready))
            for i, (label, address) in enumerate(zip(labels, addresses, strict=True)):
                details = routers.details.get(i, "")
                print(f"pagedkv serve router {label} ready on {address} {details}", flush=True)
            targets = addresses
        if args.http_port is not None:
            await _start_gateway(args, model, targets, stack, scheduler)
        await scheduler
    finally:
        signals.stopping()
        stack.stop_event.set()
        for servers in stack.servers:
            servers.terminate()
        await stack.stop_servers()
        await client.aclose()


def run_serve(args: argparse.Namespace) -> int:
    """The ``pagedkv serve`` handler: 0 after a clean stop, 1 when a child
    does not start or a scheduler fails, 2 for wrong arguments (a ``MODEL``
    that names no model, ``--executors 0``, ``--schedulers`` over 1 without
    Redis, ``--redis`` without ``redis-server``, unusable TLS or token
    files), said in one line before any child starts.

    The first SIGTERM or SIGINT stops what has started (or, once serving,
    every scheduler drains, then the executors and Redis stop); a second one
    forces the stop (``lifetime.StopSignals``)."""
    problem = check_arguments(args)
    if problem is not None:
        print(f"pagedkv serve: {problem}", file=sys.stderr)
        return 2
    stack = Stack()
    signals = StopSignals(stack.kill)
    signals.install()
    try:
        with model_dir(args.model, stack.reaper) as model:
            args.model = model
            try:
                _start_and_serve(args, model, stack, signals)
            finally:
                signals.stopping()  # from here on, a signal forces the stop
                if stack.executors is not None:
                    stack.executors.stop()
                if stack.redis is not None:
                    stack.redis.stop()
    except ListenError as exc:  # taken since the check, by a race
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    except (StartError, ServiceError) as exc:
        if isinstance(exc, StartError) and signals.num_signals:  # a child stopped by the signal
            exc = StartError("stopped before it was ready")
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"pagedkv serve: redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        return 1
    except Interrupted:
        print("pagedkv serve: stopped before it was ready", file=sys.stderr)
        return 1
    finally:
        stack.reaper.close()
        signals.restore()
    return 0


def _start_and_serve(
    args: argparse.Namespace, model: str, stack: Stack, signals: StopSignals
) -> None:
    """Starts the private Redis (``--redis``) and the executors, then serves
    until a signal; what started is left in ``stack``, for the caller to stop."""
    if args.redis:
        binary = shutil.which("redis-server") or "redis-server"
        stack.redis = PrivateRedis(binary, password=True, reaper=stack.reaper)
        args.redis_url = stack.redis.public_url
        args.redis_password_file = stack.redis.password_file
    log.info("starting executors", num_executors=args.executors, model=model, device=args.device)
    stack.executors = ExecutorProcesses(executor_commands(args, model))
    addresses = stack.executors.addresses
    if args.redis_url:
        redis_url = redis_url_with(
            args.redis_url, password_file=args.redis_password_file, tls_ca=args.redis_tls_ca
        )
        asyncio.run(_serve_cluster(args, addresses, redis_url, model, stack, signals))
    else:
        asyncio.run(_serve_alone(args, addresses, stack, signals))
