"""The SDK's error policy: one exception class per gRPC status code.

Every failed call of ``Client`` and ``AsyncClient`` raises a ``PagedkvError``
(also mid-stream, after some chunks were delivered), never a bare
``grpc.RpcError``; ``error_from_rpc`` is the one place that maps them. Bad
arguments caught before any call are plain ``ValueError``.
"""

from __future__ import annotations

import grpc


class PagedkvError(Exception):
    """A call the scheduler (or the channel) refused or failed.

    ``code`` is the gRPC status code and ``details`` its message, which names
    the offending field for INVALID_ARGUMENT (e.g. ``"sampling.top_p"``).
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code: grpc.StatusCode = code
        self.details = details


class InvalidArgumentError(PagedkvError):
    """Bad input; the details name the field."""


class ResourceExhaustedError(PagedkvError):
    """The request can never fit: its prompt needs more KV blocks than any
    executor has. (A prompt plus max_tokens over max_model_len is
    INVALID_ARGUMENT, naming ``sampling.max_tokens``.)"""


class UnavailableError(PagedkvError):
    """No executor (or no scheduler) is reachable; retrying later may work."""


class NotConnectedError(UnavailableError):
    """No connection to ``target`` could be made, so nothing was asked: no
    server listens there, its name does not resolve, or one side speaks TLS
    and the other plaintext. The details say which, with a hint."""

    def __init__(self, code: grpc.StatusCode, details: str, target: str) -> None:
        super().__init__(code, details)
        self.target = target


class AlreadyExistsError(PagedkvError):
    """The request_id is already live on this replica."""


class DeadlineExceededError(PagedkvError):
    """The call's deadline passed; the scheduler freed the request."""


class CancelledError(PagedkvError):
    """The call was cancelled (by this process or the server)."""


class FailedPreconditionError(PagedkvError):
    """The server is not in a state to run the call."""


class NotFoundError(PagedkvError):
    """Something the call named does not exist."""


class UnauthenticatedError(PagedkvError):
    """The call carried no valid credentials."""


class PermissionDeniedError(PagedkvError):
    """The caller may not make this call."""


class UnimplementedError(PagedkvError):
    """The server does not offer this method (an older server?)."""


class InternalError(PagedkvError):
    """A server-side failure, e.g. an executor lost mid-request."""


class IncompleteStreamError(PagedkvError):
    """A Generate stream ended with status OK but before its final chunk (the one
    with usage). Raised by the SDK itself, with code UNKNOWN."""


_ERRORS: dict[grpc.StatusCode, type[PagedkvError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.INTERNAL: InternalError,
}


_NOT_CONNECTED = ("failed to connect to all addresses", "errors resolving", "dns resolution")
"""Lower-case fragments of gRPC's details for a call that found no connection
(before any byte of the call was sent)."""


def not_connected_details(details: str, target: str, *, tls: bool) -> str | None:
    """What gRPC's ``details`` of an UNAVAILABLE call mean for a user when no
    connection to ``target`` was made (``tls``: the client spoke TLS); None
    when the call had a connection."""
    lowered = details.lower()
    if not any(fragment in lowered for fragment in _NOT_CONNECTED):
        return None
    if "connection refused" in lowered:
        return f"no server at {target} (connection refused)"
    if "resolving" in lowered or "dns" in lowered:
        return f"no server at {target}: its host name does not resolve"
    if not tls and "socket closed" in lowered:
        return (
            f"{target} closed the connection before answering: if it serves TLS, give the CA "
            "of its certificate (--tls-ca PATH; in the SDK, tls=TlsConfig(ca=...))"
        )
    if tls and "wrong_version_number" in lowered:
        return (
            f"no TLS server at {target} (the handshake failed): if it serves plaintext, "
            f"leave TLS off (no --tls-ca)"
        )
    return f"could not connect to {target}: {details}"


def error_from_rpc(
    exc: grpc.RpcError, *, target: str | None = None, tls: bool = False
) -> PagedkvError:
    """The typed error for a failed call (sync or ``grpc.aio``).

    Codes without a class of their own (UNKNOWN, ABORTED, OUT_OF_RANGE,
    DATA_LOSS) give a plain ``PagedkvError`` carrying the code. Given the
    ``target`` dialled (and whether the channel is ``tls``), a call that
    found no connection gives a ``NotConnectedError`` saying why.
    """
    code_method = getattr(exc, "code", None)
    code = code_method() if callable(code_method) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_method = getattr(exc, "details", None)
    details = details_method() if callable(details_method) else None
    text = details if isinstance(details, str) else str(exc)
    if target is not None and code is grpc.StatusCode.UNAVAILABLE:
        why = not_connected_details(text, target, tls=tls)
        if why is not None:
            return NotConnectedError(code, why, target)
    return _ERRORS.get(code, PagedkvError)(code, text)
