"""TLS material for every pagedkv service and the SDK.

One place turns PEM files into gRPC credentials (servers: TLS, or mutual TLS
with a CA; clients: the CA to verify the server and an optional client
certificate), opens channels with them, and reads the ``--tls-*`` flags into
a checked ``TlsConfig``. ``SecurityError`` is the one error of unusable TLS
material or token files (``bearer_tokens``); how a server is closed (TLS,
tokens, a plaintext health port) is ``server_security``. Nothing here ever
puts a key in a message, a log line or a metric label: errors name the flag
and the path only.

Torch-free; imported by the executor, the scheduler, the router and the SDK.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import grpc
import grpc.aio

PemSource = Union[str, "os.PathLike[str]", bytes]
"""A path to a PEM file (str or PathLike), or the PEM bytes themselves."""

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
