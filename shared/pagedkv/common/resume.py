"""Resuming a Generate stream that broke: which failures count as a break, on
which target to try again, and the request that continues the stream.

A stream breaks when its scheduler (or the connection to it) goes away
before the final chunk: status UNAVAILABLE, or UNKNOWN with one of gRPC's
transport messages ("Stream removed", an RST_STREAM, a reset connection).
The client then calls the next target, round robin (passing over targets
that broke a stream in the last seconds, see ``TargetHealth``), with the same request
plus ``resumed_token_ids``: every token received so far. The scheduler
continues after them (see docs/scheduler.md, "Resuming a broken stream"), so
the caller sees one stream without a duplicate or missing token. Failures of
the request itself (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL, ...), a
cancelled call and a passed deadline are never retried, nor are requests with
n > 1 or beam search (their sequences cannot be resumed), nor a stream that
already had its final chunk: a scheduler that ends a request itself (its last
executor lost: a final chunk finished ERROR, then UNAVAILABLE) has said how it
ended, and its text was flushed.

A stream that has not had any answer yet and finds no connection to its
target (nothing listening, a TLS mismatch: the SDK's ``NotConnectedError``)
has not broken: it moves at once, without a wait, to a target it has not
tried, and fails as soon as none is left ("no server at HOST:PORT").

Shared code: the client SDK resumes streams by these rules, the router
places a request on another scheduler when its call breaks before the first
chunk by the same ``is_stream_break``, and the gateway reads its targets
with ``parse_targets``. It depends on no service: ``StreamResume`` reads a chunk
through ``ReceivedChunk``, which the SDK's ``GenerateChunk`` satisfies.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import grpc

from pagedkv.common.cli import target_with_port
from pagedkv.v1 import scheduler_pb2

_URI_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
"""gRPC target schemes whose address lists are comma-separated themselves."""

_TRANSPORT_MESSAGES = (
    "stream removed",
    "rst_stream",
    "socket closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "failed to connect",
    "goaway",
)
"""Lower-case fragments of the details gRPC gives a call whose HTTP/2 stream or
connection was lost (with status UNKNOWN in some gRPC versions)."""


class ReceivedSequence(Protocol):
    """What ``StreamResume`` reads of one sequence of a chunk."""

    @property
    def index(self) -> int: ...

    @property
    def token_ids(self) -> Sequence[int]: ...


class ReceivedChunk(Protocol):
    """What ``StreamResume`` reads of a chunk delivered to the caller (the
    SDK's ``GenerateChunk``)."""

    @property
    def is_final(self) -> bool: ...

    @property
    def sequences(self) -> Sequence[ReceivedSequence]: ...


def parse_targets(target: str | Sequence[str]) -> tuple[str, ...]:
    """Scheduler targets as gRPC takes them (see ``target_with_port``).

    ``target`` is one target, several separated by commas, or a sequence of
    targets. A target with a gRPC scheme (``ipv4:a,b``) is kept whole.
    Raises ValueError when no target is given.
    """
    if isinstance(target, str):
        parts = [target] if target.startswith(_URI_SCHEMES) else target.split(",")
    else:
        parts = list(target)
    targets = tuple(target_with_port(part.strip()) for part in parts if part.strip())
    if not targets:
        raise ValueError("target: at least one scheduler target is needed")
    return targets


def is_stream_break(code: grpc.StatusCode, details: str) -> bool:
    """Whether a failed Generate call lost its scheduler (a retry elsewhere
    can work), rather than failing for what it asked."""
    if code is grpc.StatusCode.UNAVAILABLE:
        return True
    if code is grpc.StatusCode.UNKNOWN:
        lowered = details.lower()
        return any(message in lowered for message in _TRANSPORT_MESSAGES)
    return False


@dataclass(frozen=True, slots=True)
class ResumePolicy:
    """How hard a client tries to continue a broken stream.

    ``max_attempts`` bounds the calls made after a break that deliver no
    token (None: two per target, at least 3); a call that delivers tokens
    starts the count again. Before attempt ``i`` (from 0) the client waits
    ``min(backoff_s * 2**i, max_backoff_s)``. ``max_attempts=0`` turns
    resuming off.
    """

    max_attempts: int | None = None
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def attempts(self, num_targets: int) -> int:
        if self.max_attempts is not None:
            return self.max_attempts
        return max(3, 2 * num_targets)

    def delay(self, attempt: int) -> float:
        return float(min(self.backoff_s * 2**attempt, self.max_backoff_s))


class TargetHealth:
    """Which of a client's targets broke a stream lately: a target that did
    is passed over for ``cooldown_s`` seconds when a stream starts or moves
    on (unless every target is cooling down), so new streams do not keep
    knocking at a replica that is gone; a chunk from it clears it at once.
    Shared by the client's streams (thread-safe)."""

    def __init__(self, num_targets: int, cooldown_s: float = 2.0) -> None:
        self.num_targets = num_targets
        self.cooldown_s = cooldown_s
        self._turns = itertools.count()
        self._broken: dict[int, float] = {}  # target index -> monotonic time of the break
        self._lock = threading.Lock()

    def _usable(self, index: int, now: float) -> bool:
        broke = self._broken.get(index)
        return broke is None or now - broke >= self.cooldown_s

    def pick(self) -> int:
        """The target of a new stream: the next in round robin that is not
        cooling down."""
        with self._lock:
            return self._first_usable(next(self._turns) % self.num_targets)

    def next_after(self, index: int) -> int:
        """The target to move a broken stream to: the next one after
        ``index`` that is not cooling down."""
        with self._lock:
            return self._first_usable((index + 1) % self.num_targets)

    def _first_usable(self, start: int) -> int:
        now = time.monotonic()
        for offset in range(self.num_targets):
            index = (start + offset) % self.num_targets
            if self._usable(index, now):
                return index
        return start

    def broke(self, index: int) -> None:
        with self._lock:
            self._broken[index] = time.monotonic()

    def answered(self, index: int) -> None:
        if index in self._broken:
            with self._lock:
                self._broken.pop(index, None)


class Attempt(NamedTuple):
    """The next call of a stream: where, after how long a wait, with what;
    ``resumes``: whether it continues a broken stream (False: the stream's
    first call moves on from a target it could not reach)."""

    target_index: int
    delay_s: float
    request: scheduler_pb2.GenerateRequest
    resumes: bool = True


class StreamResume:
    """One Generate stream's progress over its calls.

    Owns the tokens received (sequence 0), the target in use, the count of
    failed attempts since the last token and the targets found unreachable
    before any answer; ``received`` and ``after_error`` are the only writers.
    ``timeout`` (seconds, None: none) is the whole stream's deadline, kept
    over every call.
    """

    __slots__ = (
        "_answered",
        "_deadline",
        "_failures",
        "_final",
        "_health",
        "_num_targets",
        "_policy",
        "_request",
        "_token_ids",
        "_unreached",
        "num_resumes",
        "resumable",
        "target_index",
    )

    def __init__(
        self,
        request: scheduler_pb2.GenerateRequest,
        *,
        first_target: int,
        num_targets: int,
        policy: ResumePolicy,
        timeout: float | None,
        health: TargetHealth | None = None,
    ) -> None:
        sampling = request.sampling
        self._health = health
        self._request = request
        self._policy = policy
        self._num_targets = num_targets
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._token_ids: list[int] = list(request.resumed_token_ids)
        self._failures = 0
        self._final = False
        self._answered = False
        self._unreached: set[int] = set()
        self.target_index = first_target
        self.num_resumes = 0
        self.resumable = sampling.n <= 1 and sampling.beam_width < 2

    @property
    def request(self) -> scheduler_pb2.GenerateRequest:
        """The request of the current call: the caller's, plus the tokens
        received so far as ``resumed_token_ids`` once the stream broke."""
        if len(self._token_ids) == len(self._request.resumed_token_ids):
            return self._request
        request = scheduler_pb2.GenerateRequest()
        request.CopyFrom(self._request)
        request.ClearField("resumed_token_ids")
        request.resumed_token_ids.extend(self._token_ids)
        return request

    def timeout(self) -> float | None:
        """Seconds left of the stream's deadline (None: no deadline)."""
        if self._deadline is None:
            return None
        return max(self._deadline - time.monotonic(), 0.0)

    def received(self, chunk: ReceivedChunk) -> None:
        """Records the tokens of a chunk delivered to the caller."""
        self._final = self._final or chunk.is_final
        self._answered = True
        if self._health is not None:
            self._health.answered(self.target_index)
        for seq in chunk.sequences:
            if seq.index == 0 and seq.token_ids:
                self._token_ids.extend(seq.token_ids)
                self._failures = 0

    def after_error(
        self, code: grpc.StatusCode, details: str, *, connected: bool = True
    ) -> Attempt | None:
        """The call to make after the current one failed with ``code``; None
        when the failure is final (raise it): not a break (ALREADY_EXISTS
        counts as one on a resumed call: the old replica has not yet seen
        its stream end), not resumable, after the final chunk, out of
        attempts, or out of time. ``connected=False``: the call found no
        connection; before any answer that is no break (see the module)."""
        if not connected and not self._answered:
            return self._after_no_connection()
        resuming = self.num_resumes > 0
        lost = is_stream_break(code, details)
        if lost and self._health is not None:
            self._health.broke(self.target_index)
        broken = lost or (resuming and code is grpc.StatusCode.ALREADY_EXISTS)
        if not (broken and self.resumable) or self._final:
            return None
        if self._failures >= self._policy.attempts(self._num_targets):
            return None
        delay = self._policy.delay(self._failures)
        remaining = self.timeout()
        if remaining is not None and remaining <= delay:
            return None
        self._failures += 1
        self.num_resumes += 1
        if self._health is not None:
            self.target_index = self._health.next_after(self.target_index)
        else:
            self.target_index = (self.target_index + 1) % self._num_targets
        return Attempt(self.target_index, delay, self.request)

    def _after_no_connection(self) -> Attempt | None:
        """The next target not yet tried, at once; None when every target was."""
        self._unreached.add(self.target_index)
        if self._health is not None:
            self._health.broke(self.target_index)
        untried = [
            index
            for offset in range(1, self._num_targets)
            if (index := (self.target_index + offset) % self._num_targets) not in self._unreached
        ]
        remaining = self.timeout()
        if not untried or (remaining is not None and remaining <= 0):
            return None
        self.target_index = untried[0]
        return Attempt(self.target_index, 0.0, self.request, resumes=False)
