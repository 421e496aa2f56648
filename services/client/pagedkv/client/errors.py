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
    """The request can never fit (prompt plus max_tokens over max_model_len, or
    more blocks than an executor has)."""


class UnavailableError(PagedkvError):
    """No executor (or no scheduler) is reachable; retrying later may work."""


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


def error_from_rpc(exc: grpc.RpcError) -> PagedkvError:
    """The typed error for a failed call (sync or ``grpc.aio``).

    Codes without a class of their own (UNKNOWN, ABORTED, OUT_OF_RANGE,
    DATA_LOSS) give a plain ``PagedkvError`` carrying the code.
    """
    code_method = getattr(exc, "code", None)
    code = code_method() if callable(code_method) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_method = getattr(exc, "details", None)
    details = details_method() if callable(details_method) else None
    cls = _ERRORS.get(code, PagedkvError)
    return cls(code, details if isinstance(details, str) else str(exc))
