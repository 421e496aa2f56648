"""``pagedkv router``: the router process around ``RouterService``."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from pagedkv.cluster.connection import redis_url_with
from pagedkv.common.bearer_tokens import TokenFile
from pagedkv.common.logging import get_logger
from pagedkv.common.ports import ListenError, check_free
from pagedkv.common.redis_health import follow_redis
from pagedkv.common.security import client_tls_from_args
from pagedkv.common.server_security import ServerSecurity, server_security_from_args
from pagedkv.common.tasks import cancel_and_wait
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.scoring import RoutingWeights
from pagedkv.router.service import RouterConfig, RouterService
from pagedkv.router.servicer import SERVICE_NAME, start_server

log = get_logger(__name__)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """ValueError (RedisUrlError, SecurityError) naming the option when one is wrong."""
    weights = RoutingWeights(
        args.weight_prefix,
        args.weight_load,
        args.weight_kv,
        args.load_bound,
        args.load_slack,
        args.weight_host,
    )
    if not args.refresh_interval > 0:
        raise ValueError(f"--refresh-interval: {args.refresh_interval} must be > 0")
    return RouterConfig(
        redis_url=redis_url_with(
            args.redis_url, password_file=args.redis_password_file, tls_ca=args.redis_tls_ca
        ),
        policy=args.policy,
        weights=weights,
        model_dir=args.model,
        refresh_interval_s=args.refresh_interval,
        scheduler_tls=client_tls_from_args(args, "scheduler-"),
        scheduler_token=(
            None
            if args.scheduler_token_file is None
            else TokenFile(args.scheduler_token_file, "--scheduler-token-file")
        ),
    )


async def serve_router(
    config: RouterConfig,
    host: str,
    port: int,
    metrics_port: int | None,
    drain_timeout: float,
    ready_line: str = "router",
    security: ServerSecurity | None = None,
) -> None:
    """Runs a router until SIGTERM or SIGINT; prints ``<ready_line> ready on
    HOST:PORT ...`` once it serves; its health is NOT_SERVING while Redis
    does not answer (``pagedkv.common.redis_health``). On a signal: health
    NOT_SERVING, open streams get ``drain_timeout`` seconds, then the server
    stops.
    ``security``: TLS and tokens of the gRPC server (default: plaintext, open)."""
    metrics = RouterMetrics()
    service = RouterService(config, metrics)
    await service.start()
    server = await start_server(service, f"{host}:{port}", security)
    extra = ""
    if metrics_port is not None:
        extra = f", metrics on :{metrics.serve(metrics_port, host)}"
    snapshot = service.snapshot
    print(
        f"{ready_line} ready on {host}:{server.port} ({len(snapshot.members)} schedulers, "
        f"{len(snapshot.records)} executors, policy {config.policy}{extra})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    follower = asyncio.create_task(
        follow_redis(
            server.health, ("", SERVICE_NAME), lambda: service.degraded, stop.is_set, "router"
        )
    )
    await stop.wait()
    log.info("router stopping", open_streams=service.num_open_streams)
    await cancel_and_wait([follower])
    await server.not_serving()
    deadline = time.monotonic() + drain_timeout
    while service.num_open_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.server.stop(grace=1)
    await service.stop()
    metrics.close()


def run_router(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        security = server_security_from_args(args, require_ca=False)
        # Refused before Redis is dialled; the servers' own binds still decide.
        check_free("--port", args.host, args.port)
        check_free("--health-port", args.host, args.health_port)
        check_free("--metrics-port", args.host, args.metrics_port)
    except (ValueError, ListenError) as exc:
        print(f"pagedkv router: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(
            serve_router(
                config,
                args.host,
                args.port,
                args.metrics_port,
                args.drain_timeout,
                security=security,
            )
        )
    except ListenError as exc:
        print(f"pagedkv router: {exc}", file=sys.stderr)
        return 2
    return 0
