"""The ports a pagedkv server listens on are its own.

gRPC servers set ``SO_REUSEPORT`` by default, so a second server on a port in
use binds it too and both say ready; every pagedkv gRPC server is made with
``GRPC_SERVER_OPTIONS`` (no port sharing) and binds through ``add_port``. A
port that cannot be had (the gRPC port, ``--health-port``, ``--metrics-port``)
is a ``ListenError`` naming the flag and the address; the commands print it
on one line and exit 2.

Torch-free; imported by every server.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator
from typing import Any

import grpc

GRPC_SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (("grpc.so_reuseport", 0),)
"""Options of every pagedkv gRPC server: a port in use is refused, not shared."""


class ListenError(OSError):
    """A server cannot listen on a port it was given; the message names the
    flag, the address and why ("in use" when another process holds it)."""


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` too) as (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _reason(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now ("in use", an OS message), or
    None when it can (found by binding a plain socket, with SO_REUSEADDR as
    servers set it, so a port with connections in TIME_WAIT counts as free)."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return "in use (another process listens there)"
                return exc.strerror or str(exc)
    return None


def listen_error(flag: str, host: str, port: int, reason: str | None = None) -> ListenError:
    """The ListenError for ``flag``'s ``host:port``; without ``reason``, it
    is found out now."""
    why = reason or _reason(host, port) or "cannot listen there"
    return ListenError(f"{flag} {port}: {host}:{port} {why}")


def check_free(flag: str, host: str, port: int | None) -> None:
    """Raises ListenError when ``port`` on ``host`` cannot be bound now, so
    a command can refuse it before a long start-up (port 0 and None pass:
    any free port, or none). The server's own bind still decides."""
    if not port:
        return
    reason = _reason(host, port)
    if reason is not None:
        raise listen_error(flag, host, port, reason)


def add_port(
    server: grpc.Server | grpc.aio.Server,
    address: str,
    flag: str = "--port",
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Binds ``address`` on ``server`` (made with ``GRPC_SERVER_OPTIONS``),
    with ``credentials`` (TLS) or plaintext; returns the bound port (the one
    chosen for port 0). ListenError naming ``flag`` when it cannot."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        port = 0
    if not port:
        host, wanted = split_address(address)
        raise listen_error(flag, host, wanted)
    return int(port)


@contextlib.contextmanager
def listening(flag: str, host: str, port: int) -> Iterator[None]:
    """Turns an OSError of the block (an HTTP server's bind) into a
    ListenError naming ``flag``."""
    try:
        yield
    except ListenError:
        raise
    except OSError as exc:
        reason = "in use (another process listens there)" if exc.errno == errno.EADDRINUSE else None
        raise listen_error(flag, host, port, reason or exc.strerror) from None
