"""pagedkv client SDK: ``Client`` and ``AsyncClient`` for the Scheduler gRPC service.

    from pagedkv.client import Client

    with Client("localhost:50051", timeout=60) as client:
        for chunk in client.generate("Hello", max_tokens=32, temperature=0):
            for seq in chunk.sequences:
                print(seq.text, end="", flush=True)
        print(client.generate_text("Hello", max_tokens=32).text)

Given several targets (``Client(["a:50051", "b:50051"])``), requests start on
them in turn and a stream whose scheduler goes away resumes on the next one
(``ResumePolicy``; ``pagedkv.common.resume``).

Security: ``Client(target, tls=TlsConfig(ca="ca.pem"), token="...")`` talks
TLS (``cert``/``key`` too for mutual TLS) and sends a bearer token on every
call (docs/security.md).

The options of a request (``max_tokens``, ``temperature``, ``stop`` ...) are
keyword arguments of ``generate``, declared once as ``GenerateOptions``
(``pagedkv.client.options``).

Results are frozen dataclasses (``pagedkv.client.types``, and
``pagedkv.client.stats`` for ``stats``); failed calls raise a ``PagedkvError``
subclass per gRPC status code (``pagedkv.client.errors``).
"""

from pagedkv.client.async_client import AsyncClient
from pagedkv.client.client import Client
from pagedkv.client.errors import (
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    IncompleteStreamError,
    InternalError,
    InvalidArgumentError,
    NotConnectedError,
    NotFoundError,
    PagedkvError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    error_from_rpc,
)
from pagedkv.client.options import GenerateOptions
from pagedkv.client.stats import (
    ClusterExecutor,
    ClusterView,
    ExecutorStats,
    IntegrityCheck,
    RouterView,
    Stats,
)
from pagedkv.client.types import (
    Beam,
    Completion,
    FinishReason,
    GenerateChunk,
    Placement,
    SequenceChunk,
    TokenLogprob,
    Usage,
)
from pagedkv.common.resume import ResumePolicy
from pagedkv.common.security import TlsConfig

__all__ = [
    "AlreadyExistsError",
    "AsyncClient",
    "Beam",
    "CancelledError",
    "Client",
    "ClusterExecutor",
    "ClusterView",
    "Completion",
    "DeadlineExceededError",
    "ExecutorStats",
    "FailedPreconditionError",
    "FinishReason",
    "GenerateChunk",
    "GenerateOptions",
    "IncompleteStreamError",
    "IntegrityCheck",
    "InternalError",
    "InvalidArgumentError",
    "NotConnectedError",
    "NotFoundError",
    "PagedkvError",
    "PermissionDeniedError",
    "Placement",
    "ResourceExhaustedError",
    "ResumePolicy",
    "RouterView",
    "SequenceChunk",
    "Stats",
    "TlsConfig",
    "TokenLogprob",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
    "error_from_rpc",
]
