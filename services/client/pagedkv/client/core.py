"""What ``Client`` (blocking) and ``AsyncClient`` (``grpc.aio``) share:
``ClientBase`` (targets, deadlines, metadata, error mapping, the abort
verdict) and ``GenerateStream`` (one Generate stream's resume bookkeeping).

The two clients differ only in how they call: a ``for`` or an ``async for``
over a call, ``time.sleep`` or ``asyncio.sleep`` before a resumed call, a
blocking or an awaited unary call. Everything decided about a call (which
target, which request, what a response or an error means) is decided here,
once, so the two cannot drift apart. The same split as httpx's
``BaseClient`` under ``Client`` and ``AsyncClient``.

Both take several scheduler targets. Requests start on them in turn (round
robin), and a Generate stream whose scheduler goes away mid-generation
resumes on the next one from where the caller is (``pagedkv.common.resume``):
the caller sees one stream, without a duplicate or a missing token. Every
request carries a request_id (a fresh uuid4 hex unless the caller gives one),
which a resumed call reuses.

A Generate stream is cancelled as soon as its iterator is closed before the
end (``break`` out of the loop, ``close()``/``aclose()``, garbage collection),
so the scheduler frees the request. An async generator abandoned by ``break``
is closed by the event loop shortly after; wrap it in
``contextlib.aclosing`` to cancel at the exact point you leave the loop.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence

import grpc

from pagedkv.client.errors import (
    IncompleteStreamError,
    NotConnectedError,
    PagedkvError,
    error_from_rpc,
)
from pagedkv.client.types import GenerateChunk, chunk_from_proto
from pagedkv.common.bearer_tokens import bearer_metadata
from pagedkv.common.resume import ResumePolicy, StreamResume, TargetHealth, parse_targets
from pagedkv.common.security import TlsConfig
from pagedkv.v1 import scheduler_pb2

log = logging.getLogger("pagedkv.client")

Metadata = tuple[tuple[str, str], ...]
"""The metadata every call carries (the bearer token), as gRPC takes it."""


def _metadata(token: str | None) -> Metadata | None:
    """The metadata of every call: the bearer token, if any."""
    if token is None:
        return None
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError("token: must be printable ASCII without spaces (not shown)")
    return bearer_metadata(token)


class ClientBase:
    """The state and decisions of a client of one or several Scheduler
    replicas, whichever way it calls (see ``Client`` for the arguments).

    Subclasses open one channel per target, in the order of ``targets``,
    and make the calls; ``num_resumes`` counts, over the client's life, the
    calls made to resume (or start) a stream after a break.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None,
        resume: ResumePolicy | None,
        tls: TlsConfig | None,
        token: str | None,
    ) -> None:
        self.targets = parse_targets(target)
        self.target = self.targets[0]
        self.timeout = timeout
        self.resume = resume if resume is not None else ResumePolicy()
        self.num_resumes = 0
        self._metadata = _metadata(token)
        self._tls = tls is not None
        self._health = TargetHealth(len(self.targets))
        self._lock = threading.Lock()  # num_resumes, written by streams of several threads

    def _deadline(self, call_timeout: float | None) -> float | None:
        """The deadline of a call: its own ``timeout``, else the client's."""
        return call_timeout if call_timeout is not None else self.timeout

    def _error(self, exc: grpc.RpcError, target_index: int) -> PagedkvError:
        """The typed error of a call to ``targets[target_index]`` that failed."""
        return error_from_rpc(exc, target=self.targets[target_index], tls=self._tls)

    def _target_index(self, target: str | None) -> int:
        """Where ``target`` is in ``targets`` (None: the first); ValueError if absent."""
        if target is None:
            return 0
        (normalized,) = parse_targets([target])
        if normalized not in self.targets:
            raise ValueError(f"target: {target!r} is not one of {self.targets}")
        return self.targets.index(normalized)

    def _aborted(self, outcomes: Sequence[scheduler_pb2.AbortResponse | grpc.RpcError]) -> bool:
        """``abort``'s verdict from each target's answer or failure, in the
        order of ``targets``: True if one had the request live; raises the
        first failure when no target answered."""
        answers = [o for o in outcomes if isinstance(o, scheduler_pb2.AbortResponse)]
        if not answers:
            first = outcomes[0]
            assert isinstance(first, grpc.RpcError)
            raise self._error(first, 0) from first
        return any(answer.aborted for answer in answers)

    def _open_stream(
        self, request: scheduler_pb2.GenerateRequest, timeout: float | None
    ) -> GenerateStream:
        """The bookkeeping of a new Generate stream of ``request`` (given a
        uuid4 hex request_id unless it has one), on the next target in turn."""
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        resume = StreamResume(
            request,
            first_target=self._health.pick(),
            num_targets=len(self.targets),
            policy=self.resume,
            timeout=self._deadline(timeout),
            health=self._health,
        )
        return GenerateStream(self, resume)

    def _count_resume(self) -> None:
        with self._lock:
            self.num_resumes += 1


class GenerateStream:
    """One Generate stream across its calls: what to call next, what each
    response is, and what an error means (a resumed call or the end).

    A client's stream loop calls ``stubs[target_index].Generate(request,
    timeout=timeout(), metadata=metadata)``, passes every response through
    ``chunk``, on a ``grpc.RpcError`` waits ``retry_delay(exc)`` seconds
    and calls again, and after the last response calls ``check_complete``.
    """

    def __init__(self, client: ClientBase, resume: StreamResume) -> None:
        self._client = client
        self._resume = resume
        self._final = False
        self.metadata = client._metadata

    @property
    def target_index(self) -> int:
        """The target of the next call."""
        return self._resume.target_index

    @property
    def request(self) -> scheduler_pb2.GenerateRequest:
        """The next call's request (a resumed one carries what was received)."""
        return self._resume.request

    def timeout(self) -> float | None:
        """The next call's deadline: what is left of the stream's."""
        return self._resume.timeout()

    def chunk(self, response: scheduler_pb2.GenerateResponse) -> GenerateChunk:
        """The chunk of ``response``, recorded for a resumed call."""
        chunk = chunk_from_proto(response)
        self._resume.received(chunk)
        self._final = self._final or chunk.is_final
        return chunk

    def retry_delay(self, exc: grpc.RpcError) -> float:
        """Seconds to wait before the next call after the call failed with
        ``exc``; raises its typed error instead when it ends the stream (a
        note then says how many resumed calls preceded it)."""
        error = self._client._error(exc, self._resume.target_index)
        connected = not isinstance(error, NotConnectedError)
        attempt = self._resume.after_error(error.code, error.details, connected=connected)
        if attempt is None:
            if self._resume.num_resumes:
                error.add_note(f"after {self._resume.num_resumes} resumed call(s)")
            raise error from exc
        target = self._client.targets[attempt.target_index]
        if attempt.resumes:
            log.warning(
                "Generate stream of %s broke (%s); resuming on %s with %d tokens received",
                attempt.request.request_id,
                error,
                target,
                len(attempt.request.resumed_token_ids),
            )
            self._client._count_resume()
        else:
            log.info("%s; trying %s", error.details, target)
        return attempt.delay_s

    def check_complete(self) -> None:
        """Raises ``IncompleteStreamError`` unless a final chunk came."""
        if not self._final:
            raise IncompleteStreamError(grpc.StatusCode.UNKNOWN, "stream ended without usage")
