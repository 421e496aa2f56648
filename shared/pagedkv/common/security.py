"""TLS material and bearer tokens for every pagedkv service and the SDK.

One place turns PEM files into gRPC credentials (servers: TLS, or mutual TLS
with a CA; clients: the CA to verify the server and an optional client
certificate) and reads token files. ``BearerTokenInterceptor`` closes a
grpc.aio server to calls without ``authorization: Bearer <token>``;
``token_interceptors`` present a token on every call of a grpc.aio
channel. Nothing here ever puts a token, a key or a password in a message,
a log line or a metric label: errors name the flag and the path only.

Torch-free; imported by the executor, the scheduler, the router and the SDK.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import grpc
import grpc.aio

from pagedkv.common.logging import get_logger
from pagedkv.common.ports import GRPC_SERVER_OPTIONS, add_port

log = get_logger("pagedkv.security")

PemSource = Union[str, "os.PathLike[str]", bytes]
"""A path to a PEM file (str or PathLike), or the PEM bytes themselves."""

AUTHORIZATION = "authorization"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
"""Methods a token-protected server answers without a token: Kubernetes'
gRPC probes send none. Server reflection is *not* open (grpcurl sends the
token with ``-H 'authorization: Bearer ...'``)."""

_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PRIVATE_KEY = b"PRIVATE KEY-----"


class SecurityError(ValueError):
    """TLS material or a token file that cannot be used; the message names
    the flag or field and the path, never the contents."""


@dataclass(frozen=True)
class TlsConfig:
    """The PEM material of one side of a TLS connection.

    On a server: ``cert`` and ``key`` are served, and a ``ca`` makes it
    mutual TLS (only clients with a certificate signed by that CA get
    through). On a client: ``ca`` verifies the server (None: the system's
    roots), ``cert`` and ``key`` are the client certificate (mutual TLS),
    and ``server_name`` is the name checked in the server's certificate
    (default: the target's host). ``cert`` and ``key`` go together.
    """

    ca: PemSource | None = None
    cert: PemSource | None = None
    key: PemSource | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise SecurityError("tls: cert and key go together: give both or neither")

    def read(self, field: str, flag: str = "") -> bytes | None:
        """The PEM bytes of ``field`` ("ca", "cert" or "key"), checked to
        hold what the field needs; SecurityError naming ``flag`` (default:
        ``tls.<field>``)."""
        source = getattr(self, field)
        if source is None:
            return None
        return read_pem(source, field, flag or f"tls.{field}")


def read_pem(source: PemSource, kind: str, flag: str) -> bytes:
    """``source``'s PEM bytes; ``kind`` "key" must hold a private key, "ca"
    and "cert" a certificate."""
    if isinstance(source, bytes):
        data, where = source, flag
    else:
        path = Path(source)
        where = f"{flag} {path}"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SecurityError(f"{where}: no such file") from None
        except OSError as exc:
            raise SecurityError(f"{where}: cannot read it ({exc.strerror})") from None
    marker = _PRIVATE_KEY if kind == "key" else _CERTIFICATE
    if marker not in data:
        what = "a PEM private key" if kind == "key" else "a PEM certificate"
        raise SecurityError(f"{where}: not {what}")
    return data


def server_credentials(tls: TlsConfig, flag_prefix: str = "--tls") -> grpc.ServerCredentials:
    """Server credentials serving ``tls.cert``; with ``tls.ca``, clients must
    present a certificate signed by it (mutual TLS)."""
    cert = tls.read("cert", f"{flag_prefix}-cert")
    key = tls.read("key", f"{flag_prefix}-key")
    if cert is None or key is None:
        raise SecurityError(f"{flag_prefix}-cert and {flag_prefix}-key: a server needs both")
    ca = tls.read("ca", f"{flag_prefix}-ca")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(tls: TlsConfig, flag_prefix: str = "") -> grpc.ChannelCredentials:
    """Client credentials: verify the server with ``tls.ca`` (None: the
    system's roots) and present ``tls.cert`` if given. Errors name
    ``{flag_prefix}-ca`` etc. (default: ``tls.ca`` etc.)."""

    def flag(field: str) -> str:
        return f"{flag_prefix}-{field}" if flag_prefix else ""

    return grpc.ssl_channel_credentials(
        root_certificates=tls.read("ca", flag("ca")),
        private_key=tls.read("key", flag("key")),
        certificate_chain=tls.read("cert", flag("cert")),
    )


def _channel_options(
    tls: TlsConfig | None, options: Sequence[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    if tls is not None and tls.server_name:
        return [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return list(options)


def open_channel(
    target: str, tls: TlsConfig | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to ``target``: TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, channel_credentials(tls), _channel_options(tls, options))


def open_aio_channel(
    target: str,
    tls: TlsConfig | None = None,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target``: TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(
            target, options=list(options), interceptors=list(interceptors) or None
        )
    return grpc.aio.secure_channel(
        target,
        channel_credentials(tls),
        _channel_options(tls, options),
        interceptors=list(interceptors) or None,
    )


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


class TokenFile:
    """Bearer tokens read from a file: one per line, blank lines and lines
    starting with ``#`` ignored.

    The file is checked (size, modification time, inode) on every use and
    re-read when it changed, so tokens rotate without a restart: put the new
    token in, let clients switch, take the old one out (a Kubernetes Secret
    mounted as a volume is replaced the same way). A file that becomes
    unreadable or empty keeps the last tokens read (logged, path only).
    Thread-safe. ``flag`` names the file in errors.
    """

    def __init__(self, path: str | os.PathLike[str], flag: str = "--auth-token-file") -> None:
        self.path = Path(path)
        self.flag = flag
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._tokens: tuple[bytes, ...] = ()
        self._reload(initial=True)

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _reload(self, initial: bool = False) -> None:
        where = f"{self.flag} {self.path}"
        try:
            stamp = self._stat()
            tokens = parse_tokens(self.path.read_text(encoding="utf-8"), where)
        except (OSError, UnicodeDecodeError, SecurityError) as exc:
            reason = exc if isinstance(exc, SecurityError) else f"{where}: cannot read it"
            if initial:
                if isinstance(exc, FileNotFoundError):
                    raise SecurityError(f"{where}: no such file") from None
                raise SecurityError(str(reason)) from None
            log.warning("token file unusable; keeping the tokens read before", error=str(reason))
            return
        if not initial and tokens != self._tokens:
            log.info("token file re-read", path=str(self.path), num_tokens=len(tokens))
        self._stamp, self._tokens = stamp, tokens

    def tokens(self) -> tuple[bytes, ...]:
        """The tokens now (the file re-read if it changed)."""
        with self._lock:
            try:
                changed = self._stat() != self._stamp
            except OSError:
                changed = True
            if changed:
                self._reload()
            return self._tokens

    def accepts(self, token: bytes) -> bool:
        """Whether ``token`` is one of the tokens; compares with every one in
        constant time (no early exit on the first match)."""
        matched = False
        for known in self.tokens():
            matched |= hmac.compare_digest(known, token)
        return matched

    def first(self) -> str:
        """The token to present (the file's first)."""
        return self.tokens()[0].decode()


def parse_tokens(content: str, where: str) -> tuple[bytes, ...]:
    """The tokens of a token file's ``content``; SecurityError (with the
    line number, not the line) for a line that is no token."""
    tokens: list[bytes] = []
    for number, line in enumerate(content.splitlines(), start=1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
            raise SecurityError(
                f"{where}: line {number} is not a token (printable ASCII without spaces)"
            )
        tokens.append(token.encode())
    if not tokens:
        raise SecurityError(f"{where}: no token in it (one per line; # starts a comment)")
    return tuple(tokens)


def read_token(path: str | os.PathLike[str], flag: str = "--token-file") -> str:
    """The first token of a token file (what a client presents)."""
    return TokenFile(path, flag).first()


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata presenting ``token``."""
    return ((AUTHORIZATION, f"Bearer {token}"),)


def presented_token(metadata: Any) -> bytes | None:
    """The token of a call's ``authorization: Bearer <token>`` metadata, if any."""
    for key, value in metadata or ():
        if key != AUTHORIZATION:
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip().encode()
        return None
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answers UNAUTHENTICATED to every call without a bearer token that
    ``tokens`` accepts, but the health service's (``OPEN_METHOD_PREFIXES``).
    The handler is looked up first, so an unknown method stays UNIMPLEMENTED."""

    def __init__(
        self, tokens: TokenFile, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES
    ) -> None:
        self.token_file = tokens
        self.open_prefixes = tuple(open_prefixes)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.open_prefixes):
            return handler
        token = presented_token(details.invocation_metadata)
        if token is not None and self.token_file.accepts(token):
            return handler
        why = "no bearer token" if token is None else "the bearer token is not accepted"
        log.info("call refused", method=details.method, reason=why)
        return _refusing(handler, f"{why} (send authorization: Bearer <token>)")


def _refusing(handler: Any, details: str) -> Any:
    """``handler`` with its behaviour replaced by an UNAUTHENTICATED abort."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    for name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, name) is not None:
            return handler._replace(**{name: refuse})
    return handler


class _TokenInterceptor:
    """Presents ``token()`` (called per call, so a rotated token file is
    picked up) as the ``authorization`` of a call, replacing any the call
    carried."""

    def __init__(self, token: Callable[[], str]) -> None:
        self.token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(
            *((k, v) for k, v in (details.metadata or ()) if k != AUTHORIZATION),
            *bearer_metadata(self.token()),
        )
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
        )


class _UnaryUnaryToken(_TokenInterceptor, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_TokenInterceptor, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryToken(_TokenInterceptor, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), requests)


class _StreamStreamToken(_TokenInterceptor, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), requests)


def token_interceptors(token: Callable[[], str]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a grpc.aio channel that present ``token()`` on every
    call of every kind, replacing the ``authorization`` a call carried.

    One per kind of call: a grpc.aio channel files each interceptor under
    the first kind it is an instance of, so one object declared for several
    kinds would see only the first kind's calls."""
    return [
        _UnaryUnaryToken(token),
        _UnaryStreamToken(token),
        _StreamUnaryToken(token),
        _StreamStreamToken(token),
    ]


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


def server_tls_from_args(args: argparse.Namespace, *, require_ca: bool) -> TlsConfig | None:
    """``--tls-cert``/``--tls-key``/``--tls-ca`` as a checked TlsConfig (the
    files read once, so a bad one fails at start); None without them.
    ``require_ca``: a certificate without ``--tls-ca`` is refused (a server
    that must accept only clients of the cluster CA)."""
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_ca
    if cert is None and key is None:
        if ca is not None:
            raise SecurityError("--tls-ca needs --tls-cert and --tls-key (the server's own)")
        return None
    if cert is None or key is None:
        raise SecurityError("--tls-cert and --tls-key go together: give both or neither")
    if require_ca and ca is None:
        raise SecurityError(
            "--tls-cert needs --tls-ca here: this server accepts only clients with a "
            "certificate signed by the cluster CA (mutual TLS)"
        )
    tls = TlsConfig(ca=ca, cert=cert, key=key)
    server_credentials(tls)  # reads and checks every file now
    return tls


def client_tls_from_args(args: argparse.Namespace, prefix: str) -> TlsConfig | None:
    """``--{prefix}tls-ca``/``-cert``/``-key``/``-server-name`` as a checked
    client TlsConfig; None without them. A client certificate or a server
    name needs the CA (it turns TLS on)."""
    dest = prefix.replace("-", "_")
    ca, cert, key = (getattr(args, f"{dest}tls_{n}") for n in ("ca", "cert", "key"))
    server_name = getattr(args, f"{dest}tls_server_name", None)
    flag = f"--{prefix}tls"
    if ca is None:
        if cert is not None or key is not None:
            raise SecurityError(f"{flag}-cert and {flag}-key need {flag}-ca (it turns TLS on)")
        if server_name is not None:
            raise SecurityError(f"{flag}-server-name needs {flag}-ca (it turns TLS on)")
        return None
    if (cert is None) != (key is None):
        raise SecurityError(f"{flag}-cert and {flag}-key go together: give both or neither")
    tls = TlsConfig(ca=ca, cert=cert, key=key, server_name=server_name)
    channel_credentials(tls, flag)  # reads and checks every file now
    return tls


def server_security_from_args(args: argparse.Namespace, *, require_ca: bool) -> ServerSecurity:
    """The server's TLS, its ``--health-port`` and, where it has
    ``--auth-token-file``, its tokens."""
    tls = server_tls_from_args(args, require_ca=require_ca)
    token_file = getattr(args, "auth_token_file", None)
    tokens = None if token_file is None else TokenFile(token_file, "--auth-token-file")
    return ServerSecurity(tls=tls, tokens=tokens, health_port=getattr(args, "health_port", None))
