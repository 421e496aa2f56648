"""How a server is closed: ``ServerSecurity`` (TLS, bearer tokens, a
plaintext health port) read from a server's flags, its ports bound with it,
and the health-only servers beside a closed port.

Torch-free; imported by the executor, the scheduler and the router.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from pagedkv.common.bearer_tokens import BearerTokenInterceptor, TokenFile
from pagedkv.common.ports import GRPC_SERVER_OPTIONS, add_port
from pagedkv.common.security import TlsConfig, server_credentials, server_tls_from_args


@dataclass(frozen=True)
class ServerSecurity:
    """How a server is closed: TLS (``tls.cert``/``tls.key``; mutual with
    ``tls.ca``) and bearer tokens (``tokens``; grpc.aio servers only);
    ``health_port``: a plaintext port serving health alone, on the server's
    host (``start_health_server``)."""

    tls: TlsConfig | None = None
    tokens: TokenFile | None = None
    health_port: int | None = None

    def health_address(self, address: str) -> str | None:
        """Where the health port listens, for a server on ``address``."""
        if self.health_port is None:
            return None
        return f"{address.rpartition(':')[0]}:{self.health_port}"

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.tokens is None else [BearerTokenInterceptor(self.tokens)]

    def describe(self) -> str:
        """For ready lines: "plaintext", "TLS", "mutual TLS", "+ tokens"."""
        if self.tls is None:
            what = "plaintext"
        else:
            what = "mutual TLS" if self.tls.ca is not None else "TLS"
        return what + (", bearer tokens" if self.tokens is not None else "")


def bind(
    server: grpc.Server | grpc.aio.Server,
    address: str,
    security: ServerSecurity,
    flag: str = "--port",
) -> int:
    """Adds a port for ``address`` to ``server`` (TLS when ``security`` has
    a certificate); returns the bound port. ``server`` is made with
    ``GRPC_SERVER_OPTIONS`` (no port sharing); ListenError naming ``flag``
    when the port cannot be had."""
    credentials = None if security.tls is None else server_credentials(security.tls)
    return add_port(server, address, flag, credentials)


def start_health_server(health_servicer: Any, address: str, main: grpc.Server) -> grpc.Server:
    """A plaintext server of ``health_servicer`` alone on ``address``, for
    Kubernetes' gRPC probes (they speak neither TLS nor tokens); stopped
    when ``main`` stops. The health service tells only SERVING or
    NOT_SERVING, so it may stay plaintext beside a TLS port. ListenError
    (``--health-port``) when the port cannot be had."""
    from concurrent import futures

    from grpc_health.v1 import health_pb2_grpc

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), options=list(GRPC_SERVER_OPTIONS)
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind(server, address, ServerSecurity(), "--health-port")
    server.start()

    def stop_with_main() -> None:
        main.wait_for_termination()
        server.stop(None)

    threading.Thread(target=stop_with_main, daemon=True, name="health-port").start()
    return server


_health_tasks: set[asyncio.Task[None]] = set()


def aio_health_server(health_servicer: Any, address: str) -> grpc.aio.Server:
    """A grpc.aio server of ``health_servicer`` alone, its port on
    ``address`` bound but not serving yet (``serve_aio_health`` starts it);
    ListenError (``--health-port``) when the port cannot be had."""
    from grpc_health.v1 import health_pb2_grpc

    server = grpc.aio.server(options=list(GRPC_SERVER_OPTIONS))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind(server, address, ServerSecurity(), "--health-port")
    return server


async def serve_aio_health(server: grpc.aio.Server, main: grpc.aio.Server) -> None:
    """Starts the health ``server``; it stops when ``main`` stops."""
    await server.start()

    async def stop_with_main() -> None:
        await main.wait_for_termination()
        await server.stop(None)

    task = asyncio.create_task(stop_with_main())
    _health_tasks.add(task)
    task.add_done_callback(_health_tasks.discard)


async def start_aio_health_server(
    health_servicer: Any, address: str, main: grpc.aio.Server
) -> grpc.aio.Server:
    """``start_health_server`` for grpc.aio servers (the same health
    servicer object serves both ports, so draining shows on both)."""
    server = aio_health_server(health_servicer, address)
    await serve_aio_health(server, main)
    return server


def server_security_from_args(args: argparse.Namespace, *, require_ca: bool) -> ServerSecurity:
    """The server's TLS, its ``--health-port`` and, where it has
    ``--auth-token-file``, its tokens."""
    tls = server_tls_from_args(args, require_ca=require_ca)
    token_file = getattr(args, "auth_token_file", None)
    tokens = None if token_file is None else TokenFile(token_file, "--auth-token-file")
    return ServerSecurity(tls=tls, tokens=tokens, health_port=getattr(args, "health_port", None))
