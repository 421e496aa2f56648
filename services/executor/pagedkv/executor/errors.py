"""The executor's error policy: a domain exception per gRPC status code.

Code below the servicer raises these for caller misuse (``assert`` stays for
internal invariants); one interceptor in servicer.py turns them into the
status code and message. Messages name the offending field, e.g.
``"new_block_ids[3]: block 9000 >= num_blocks 8192"``.
"""

from __future__ import annotations

import grpc


class ExecutorError(Exception):
    """A refused call; nothing was changed."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ExecutorError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(ExecutorError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ExecutorError):
    code = grpc.StatusCode.FAILED_PRECONDITION
