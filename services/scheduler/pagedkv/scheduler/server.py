"""``pagedkv scheduler``: the scheduler process around ``SchedulerService``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import signal
import sys
from collections.abc import Callable

from pagedkv.cluster.connection import redis_url_with
from pagedkv.common.errors import ServiceError
from pagedkv.common.logging import get_logger
from pagedkv.common.ports import ListenError
from pagedkv.common.security import client_tls_from_args
from pagedkv.common.server_security import ServerSecurity, server_security_from_args
from pagedkv.common.step_contract import default_pipeline_depth
from pagedkv.scheduler.config import ClusterConfig, SchedulerConfig
from pagedkv.scheduler.metrics import SchedulerMetrics
from pagedkv.scheduler.service import SchedulerService
from pagedkv.scheduler.servicer import bind_server, start_server

log = get_logger(__name__)


def config_from_args(
    args: argparse.Namespace, executors: list[str], port: int | None = None
) -> SchedulerConfig:
    """``args``: ``pagedkv scheduler``'s or ``pagedkv serve``'s (their scheduler
    options, with the CLI's defaults). ``port``: the one the scheduler binds,
    for its member record.
    ValueError (RedisUrlError, SecurityError) naming the option when one is wrong."""
    cluster = None
    if getattr(args, "redis_url", None):
        address = args.advertise_address or f"{args.host}:{port if port is not None else args.port}"
        redis_url = redis_url_with(
            args.redis_url,
            password_file=getattr(args, "redis_password_file", None),
            tls_ca=getattr(args, "redis_tls_ca", None),
        )
        cluster = ClusterConfig(
            redis_url=redis_url,
            address=address,
            lease_ttl=args.lease_ttl,
            drain_timeout=args.drain_timeout,
        )
    return SchedulerConfig(
        executors=tuple(executors),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        stream_pace_per_stream=getattr(args, "stream_pace_us", 150.0) * 1e-6,
        decode_window=args.decode_window,
        host_loads=getattr(args, "host_loads", "auto"),
        host_offload=getattr(args, "host_offload", "eviction"),
        host_idle_offload_blocks=getattr(args, "host_idle_offload_blocks", 0),
        pipeline_depth=(
            default_pipeline_depth(args.decode_window)
            if args.pipeline_depth is None
            else args.pipeline_depth
        ),
        executor_timeout=args.executor_timeout,
        model_dir=args.model,
        cluster=cluster,
        executor_tls=(
            client_tls_from_args(args, "executor-") if hasattr(args, "executor_tls_ca") else None
        ),
    )


async def serve_scheduler(
    config: SchedulerConfig,
    host: str,
    port: int,
    metrics_port: int | None,
    ready_line: str = "scheduler",
    drain_timeout: float = 30.0,
    security: ServerSecurity | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str, str], None] | None = None,
) -> None:
    """Runs a scheduler until SIGTERM or SIGINT; prints ``<ready_line> ready
    on HOST:PORT ...`` once it serves. The metrics endpoint (with
    ``metrics_port``) listens on ``host`` too, like the gRPC server, and is
    plaintext and open (it holds no secret). ``security``: TLS and tokens of
    the gRPC server (default: plaintext, open). ``stop``: runs until the
    caller sets it instead (the caller handles the signals). ``on_ready``:
    called with HOST:PORT and the ready line's metrics part (", metrics on
    :PORT" or "") instead of printing the ready line."""
    metrics = SchedulerMetrics()
    # Every port first: one in use stops the scheduler (ListenError) before
    # it takes anything over, and a member registers the port it holds.
    bound_server = bind_server(f"{host}:{port}", security)
    server, bound = bound_server.server, bound_server.port
    if config.cluster is not None and not port:
        cluster = dataclasses.replace(config.cluster, address=f"{host}:{bound}")
        config = dataclasses.replace(config, cluster=cluster)
    extra = ""
    if metrics_port is not None:
        extra = f", metrics on :{metrics.serve(metrics_port, host)}"
    service = SchedulerService(config, metrics)
    await service.start()
    await start_server(bound_server, service)
    # What start-up made (modules, the tokenizer) lives as long as the
    # process: out of the collector's way, its full collections stay short.
    gc.freeze()
    if on_ready is not None:
        on_ready(f"{host}:{bound}", extra)
    else:
        executors = service.executors
        print(
            f"{ready_line} ready on {host}:{bound} ({len(executors.schedulers)} executors, "
            f"model {executors.info.model_id or 'not known yet'}{extra})",
            flush=True,
        )
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("scheduler stopping")
    await service.shutdown(drain_timeout)
    await server.stop(grace=2)


def run_scheduler(args: argparse.Namespace) -> int:
    if bool(args.executors) == bool(args.redis_url):
        print(
            "pagedkv scheduler: give --executor HOST:PORT (repeat for each) or --redis-url URL",
            file=sys.stderr,
        )
        return 2
    if (args.redis_password_file or args.redis_tls_ca) and not args.redis_url:
        print(
            "pagedkv scheduler: --redis-password-file and --redis-tls-ca need --redis-url",
            file=sys.stderr,
        )
        return 2
    try:
        config = config_from_args(args, args.executors)
        security = server_security_from_args(args, require_ca=False)
    except ValueError as exc:
        print(f"pagedkv scheduler: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(
            serve_scheduler(
                config,
                args.host,
                args.port,
                args.metrics_port,
                drain_timeout=args.drain_timeout,
                security=security,
            )
        )
    except ListenError as exc:
        print(f"pagedkv scheduler: {exc}", file=sys.stderr)
        return 2
    except ServiceError as exc:
        print(f"pagedkv scheduler: {exc}", file=sys.stderr)
        return 1
    return 0
