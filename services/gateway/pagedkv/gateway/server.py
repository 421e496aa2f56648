"""``pagedkv gateway``: the gateway process, uvicorn serving the app in one
asyncio event loop (no thread per request).

The listening socket is bound here (``--port 0``: any free port), so the
ready line ``gateway ready on HOST:PORT (...)`` names the port serving, and
a port in use is a one-line error (exit 2) before anything starts. On
SIGTERM or SIGINT uvicorn stops accepting connections, closes idle ones and
lets requests in flight (streams included) finish for up to
``--drain-timeout`` seconds, then cancels what is left (their gRPC calls
with them); a second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn

from pagedkv.common.bearer_tokens import TokenFile
from pagedkv.common.logging import get_logger
from pagedkv.common.model_source import ModelNotFound, resolve_model
from pagedkv.common.ports import ListenError, listening
from pagedkv.common.resume import parse_targets
from pagedkv.common.security import client_tls_from_args
from pagedkv.gateway.app import GatewayConfig, create_app

log = get_logger(__name__)

READY_POLL_S = 0.01


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """ValueError (SecurityError, ModelNotFound) naming the option when one is wrong."""
    targets = parse_targets(args.target)
    try:
        model_dir = resolve_model(args.model)
    except ModelNotFound as exc:
        raise ValueError(f"--model {args.model}: {exc}") from None
    names = tuple(n.strip() for n in (args.served_model_name or args.model).split(",") if n.strip())
    return GatewayConfig.from_model_dir(
        model_dir,
        targets=targets,
        served_model_names=names,
        auth_tokens=(None if args.auth_token_file is None else TokenFile(args.auth_token_file)),
        tls=client_tls_from_args(args, ""),
        target_token=(
            None if args.token_file is None else TokenFile(args.token_file, "--token-file")
        ),
    )


class _Server(uvicorn.Server):
    """uvicorn's server with pagedkv's stop signals: the first SIGTERM or
    SIGINT drains, a second one stops at once, and the process then exits
    with status 0 (uvicorn's own re-raises the signal once it has stopped)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        log.info("gateway draining", signal=signal.Signals(sig).name)
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (SO_REUSEADDR, so a restart
    can have the port at once); ListenError naming ``--port``."""
    with listening("--port", host, port):
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
    sock.setblocking(False)
    return sock


async def serve_gateway(
    config: GatewayConfig,
    sock: socket.socket,
    drain_timeout: float,
    ready_line: str = "gateway",
) -> None:
    """Serves the gateway on ``sock`` until SIGTERM or SIGINT (see the module
    docstring); prints ``<ready_line> ready on HOST:PORT (...)`` once it serves."""
    app = create_app(config)
    # uvicorn's start and stop lines: the ready line and our own log say it
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    uv_config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="on",
        http="httptools",
        timeout_graceful_shutdown=max(int(drain_timeout), 1),
        timeout_keep_alive=30,
    )
    server = _Server(uv_config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            await serving  # its error, or an exit before it started
            return
        await asyncio.sleep(READY_POLL_S)
    host, port = sock.getsockname()[:2]
    names = ", ".join(config.served_model_names)
    print(
        f"{ready_line} ready on {host}:{port} (OpenAI API, model {names}, "
        f"{len(config.targets)} targets: {', '.join(config.targets)})",
        flush=True,
    )
    await serving
    log.info("gateway stopped")


def run_gateway(args: argparse.Namespace) -> int:
    """The ``pagedkv gateway`` handler: 0 after a clean stop, 2 for wrong
    arguments or a port that cannot be had (said in one line)."""
    try:
        config = config_from_args(args)
        if not args.drain_timeout >= 0:
            raise ValueError(f"--drain-timeout {args.drain_timeout}: must be >= 0")
        sock = bind_socket(args.host, args.port)
    except (ValueError, ListenError) as exc:
        print(f"pagedkv gateway: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve_gateway(config, sock, args.drain_timeout))
    return 0
