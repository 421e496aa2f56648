"""The scheduler's error policy: a domain exception per gRPC status code,
raised for caller misuse and turned into the status in the servicer. Messages
name the offending field, e.g. ``"sampling.top_p: 1.5 is not in (0, 1]"``."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED
