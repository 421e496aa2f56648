"""Bearer tokens: token files, and the interceptors that ask for them on a
server and present them on a channel.

``TokenFile`` reads the tokens a server accepts (re-read when the file
changes, so tokens rotate without a restart); ``BearerTokenInterceptor``
closes a grpc.aio server to calls without ``authorization: Bearer <token>``;
``token_interceptors`` present a token on every call of a grpc.aio channel.
Nothing here ever puts a token in a message, a log line or a metric label:
errors name the flag and the path only.

Torch-free; imported by the scheduler, the router, the gateway and the SDK.
"""

from __future__ import annotations

import hmac
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from pagedkv.common.logging import get_logger
from pagedkv.common.security import SecurityError

log = get_logger("pagedkv.security")

AUTHORIZATION = "authorization"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
"""Methods a token-protected server answers without a token: Kubernetes'
gRPC probes send none. Server reflection is *not* open (grpcurl sends the
token with ``-H 'authorization: Bearer ...'``)."""


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
