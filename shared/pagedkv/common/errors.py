"""The services' error policy: a domain exception per gRPC status code.

Code below a servicer raises these for caller misuse (``assert`` stays for
internal invariants); the servicer turns them into the status code and the
message, which names the offending field (e.g. ``"sampling.top_p: 1.5 is not
in (0, 1]"``). A refused call has changed nothing.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """A refused call; ``code`` is its gRPC status."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
