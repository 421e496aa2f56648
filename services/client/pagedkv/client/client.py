"""``Client`` (blocking) and ``AsyncClient`` (``grpc.aio``) for the Scheduler service.

Both build requests with ``generate_request`` (which checks the arguments
before any call), convert responses with ``pagedkv.client.types`` and raise
``pagedkv.client.errors`` types for every failed call, also mid-stream.

Both take several scheduler targets. Requests start on them in turn (round
robin), and a Generate stream whose scheduler goes away mid-generation
resumes on the next one from where the caller is (``pagedkv.client.resume``):
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

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Generator, Sequence
from types import TracebackType

import grpc
import grpc.aio

from pagedkv.client.errors import (
    IncompleteStreamError,
    NotConnectedError,
    PagedkvError,
    error_from_rpc,
)
from pagedkv.client.resume import (
    Attempt,
    ResumePolicy,
    StreamResume,
    TargetHealth,
    parse_targets,
)
from pagedkv.client.types import (
    Completion,
    GenerateChunk,
    Stats,
    chunk_from_proto,
    stats_from_proto,
)
from pagedkv.common.security import TlsConfig, bearer_metadata, open_aio_channel, open_channel
from pagedkv.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("pagedkv.client")

_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


def _check_uint(name: str, value: int, limit: int = _UINT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ValueError(f"{name}: must be an integer in [0, {limit}], got {value!r}")
    return value


def generate_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    n: int = 1,
    beam_width: int = 0,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    stop: str | Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    min_tokens: int = 0,
    logprobs: int | None = None,
    cache_salt: str = "",
    priority: int = 0,
    request_id: str = "",
    skip_text: bool = False,
) -> scheduler_pb2.GenerateRequest:
    """The GenerateRequest for these arguments (see ``Client.generate``).

    Optional sampling fields left as None stay unset in the proto, so the
    scheduler applies its defaults. Raises ValueError, naming the argument,
    unless exactly one of ``prompt`` and ``token_ids`` is given or when an
    id or count is not a non-negative integer; every other check (ranges,
    vocabulary, lengths) is the scheduler's, answered with INVALID_ARGUMENT.
    """
    if (prompt is None) == (token_ids is None):
        raise ValueError("prompt: exactly one of prompt and token_ids must be given")
    sampling = common_pb2.SamplingParams(
        top_k=_check_uint("top_k", top_k),
        n=_check_uint("n", n),
        beam_width=_check_uint("beam_width", beam_width),
        stop_token_ids=[
            _check_uint(f"stop_token_ids[{i}]", t) for i, t in enumerate(stop_token_ids)
        ],
        ignore_eos=ignore_eos,
        stop=[stop] if isinstance(stop, str) else stop,
        include_stop_str_in_output=include_stop_str_in_output,
        min_tokens=_check_uint("min_tokens", min_tokens),
    )
    if max_tokens is not None:
        sampling.max_tokens = _check_uint("max_tokens", max_tokens)
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = _check_uint("seed", seed, _UINT64_MAX)
    if logprobs is not None:
        sampling.logprobs = _check_uint("logprobs", logprobs)
    request = scheduler_pb2.GenerateRequest(
        request_id=request_id,
        sampling=sampling,
        cache_salt=cache_salt,
        priority=priority,
        skip_text=skip_text,
    )
    if prompt is not None:
        request.text = prompt
    else:
        assert token_ids is not None
        ids = [_check_uint(f"token_ids[{i}]", t) for i, t in enumerate(token_ids)]
        request.token_ids.CopyFrom(scheduler_pb2.TokenIds(ids=ids))
    return request


def _deadline(call_timeout: float | None, default: float | None) -> float | None:
    return call_timeout if call_timeout is not None else default


def _with_request_id(request: scheduler_pb2.GenerateRequest) -> scheduler_pb2.GenerateRequest:
    """``request`` with a request_id: a uuid4 hex unless it has one (mutated)."""
    if not request.request_id:
        request.request_id = uuid.uuid4().hex
    return request


def _log_attempt(attempt: Attempt, error: PagedkvError, target: str) -> None:
    if not attempt.resumes:
        log.info("%s; trying %s", error.details, target)
        return
    log.warning(
        "Generate stream of %s broke (%s); resuming on %s with %d tokens received",
        attempt.request.request_id,
        error,
        target,
        len(attempt.request.resumed_token_ids),
    )


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call carries: the bearer token, if any."""
    if token is None:
        return None
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError("token: must be printable ASCII without spaces (not shown)")
    return bearer_metadata(token)


def _next_attempt(resume: StreamResume, error: PagedkvError) -> Attempt | None:
    """The stream's next call after ``error``; None: ``error`` is final (a
    note then says how many resumed calls preceded it)."""
    connected = not isinstance(error, NotConnectedError)
    attempt = resume.after_error(error.code, error.details, connected=connected)
    if attempt is None and resume.num_resumes:
        error.add_note(f"after {resume.num_resumes} resumed call(s)")
    return attempt


def _target_index(targets: tuple[str, ...], target: str | None) -> int:
    """Where ``target`` is in ``targets`` (None: the first); ValueError if absent."""
    if target is None:
        return 0
    (normalized,) = parse_targets([target])
    if normalized not in targets:
        raise ValueError(f"target: {target!r} is not one of {targets}")
    return targets.index(normalized)


class Client:
    """A blocking client of one or several Scheduler replicas.

    ``target`` is "host:port" (a host alone: the scheduler's default port
    50051), a sequence of them, or one string of them separated by commas.
    ``targets`` holds them with their ports, ``target`` the first. Generate
    calls start on the targets in turn; a broken stream resumes on the next
    one as ``resume`` says (default ``ResumePolicy()``; see
    ``pagedkv.client.resume``), and ``num_resumes`` counts the calls made to
    resume (or start) a stream after a break, over the client's life.

    Owns its channels: close them with ``close()`` or a ``with`` block. Safe
    to share between threads. ``timeout`` (seconds) is the default deadline of
    every call, a whole Generate stream included (its resumed calls too);
    None means no deadline.

    ``tls`` (a ``TlsConfig`` of PEM paths or bytes: ``ca`` to verify the
    servers, ``cert`` and ``key`` for mutual TLS) makes every channel TLS;
    ``token`` is sent as ``authorization: Bearer <token>`` on every call,
    resumed ones included. Neither ever appears in an error or a log line.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = None,
        resume: ResumePolicy | None = None,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        self.targets = parse_targets(target)
        self.target = self.targets[0]
        self.timeout = timeout
        self.resume = resume if resume is not None else ResumePolicy()
        self.num_resumes = 0
        self._metadata = _metadata(token)
        self._tls = tls is not None
        self._channels = [open_channel(t, tls) for t in self.targets]
        self._stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self._channels]
        self._health = TargetHealth(len(self.targets))
        self._lock = threading.Lock()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channels; calls in flight are cancelled."""
        for channel in self._channels:
            channel.close()

    def _error(self, exc: grpc.RpcError, target_index: int) -> PagedkvError:
        """The typed error of a call to ``targets[target_index]`` that failed."""
        return error_from_rpc(exc, target=self.targets[target_index], tls=self._tls)

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        n: int = 1,
        beam_width: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        logprobs: int | None = None,
        cache_salt: str = "",
        priority: int = 0,
        request_id: str = "",
        skip_text: bool = False,
        timeout: float | None = None,
    ) -> Generator[GenerateChunk, None, None]:
        """Streams the chunks of one generation, the last one carrying usage.

        Give exactly one of ``prompt`` (text, tokenized by the scheduler) and
        ``token_ids``; arguments are checked now (ValueError) and the call
        starts at the first ``next()``. The sampling arguments are those of
        ``SamplingParams`` in common.proto; None leaves a field to the
        scheduler's default. Lower ``priority`` is more important; an empty
        ``request_id`` gets a uuid4 hex. ``skip_text``: token ids only, no
        text is made (every chunk's text is empty). ``stop``: stop strings
        (one string is one stop string); the text ends before the one that
        ends first (after it with ``include_stop_str_in_output``), and the
        sequence's last chunk names it (``SequenceChunk.stop_string``).
        A stream that breaks (its scheduler
        gone) continues on the next target, unless ``n`` > 1 or beam search.
        Raises a ``PagedkvError`` when the call fails, also after some
        chunks, and ``IncompleteStreamError`` when it ends without a final
        chunk. Closing the iterator early cancels the call.
        """
        request = generate_request(
            prompt,
            token_ids=token_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            n=n,
            beam_width=beam_width,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            min_tokens=min_tokens,
            logprobs=logprobs,
            cache_salt=cache_salt,
            priority=priority,
            request_id=request_id,
            skip_text=skip_text,
        )
        return self._stream(request, _deadline(timeout, self.timeout))

    def _stream(
        self, request: scheduler_pb2.GenerateRequest, timeout: float | None
    ) -> Generator[GenerateChunk, None, None]:
        resume = StreamResume(
            _with_request_id(request),
            first_target=self._health.pick(),
            num_targets=len(self.targets),
            policy=self.resume,
            timeout=timeout,
            health=self._health,
        )
        final = False
        while True:
            call = self._stubs[resume.target_index].Generate(
                resume.request, timeout=resume.timeout(), metadata=self._metadata
            )
            try:
                for response in call:
                    chunk = chunk_from_proto(response)
                    resume.received(chunk)
                    final = final or chunk.is_final
                    yield chunk
                break
            except grpc.RpcError as exc:
                error = self._error(exc, resume.target_index)
                attempt = _next_attempt(resume, error)
                if attempt is None:
                    raise error from exc
                _log_attempt(attempt, error, self.targets[attempt.target_index])
            finally:
                call.cancel()  # a no-op once the call has ended
            if attempt.resumes:
                with self._lock:
                    self.num_resumes += 1
            time.sleep(attempt.delay_s)
        if not final:
            raise IncompleteStreamError(grpc.StatusCode.UNKNOWN, "stream ended without usage")

    def generate_text(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        n: int = 1,
        beam_width: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        logprobs: int | None = None,
        cache_salt: str = "",
        priority: int = 0,
        request_id: str = "",
        skip_text: bool = False,
        timeout: float | None = None,
    ) -> Completion:
        """Runs ``generate`` with the same arguments to the end and returns the
        accumulated result; raises as ``generate`` does."""
        chunks = self.generate(
            prompt,
            token_ids=token_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            n=n,
            beam_width=beam_width,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            min_tokens=min_tokens,
            logprobs=logprobs,
            cache_salt=cache_salt,
            priority=priority,
            request_id=request_id,
            skip_text=skip_text,
            timeout=timeout,
        )
        return Completion.from_chunks(chunks)

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Aborts a live request on every target (its stream ends with a
        chunk finished ABORT). True if it was live on one; False if unknown
        or already finished everywhere. Idempotent. Targets that are
        unreachable are skipped; raises only when no target answered."""
        request = scheduler_pb2.AbortRequest(request_id=request_id)
        aborted, errors = False, []
        for stub in self._stubs:
            try:
                response = stub.Abort(
                    request, timeout=_deadline(timeout, self.timeout), metadata=self._metadata
                )
            except grpc.RpcError as exc:
                errors.append(exc)
                continue
            aborted = aborted or response.aborted
        if len(errors) == len(self._stubs):
            raise self._error(errors[0], 0) from errors[0]
        return aborted

    def stats(self, *, target: str | None = None, timeout: float | None = None) -> Stats:
        """A snapshot of one replica's load, executors and block-pool
        integrity: ``target`` (one of ``targets``; default: the first)."""
        index = _target_index(self.targets, target)
        stub = self._stubs[index]
        try:
            response = stub.GetStats(
                scheduler_pb2.GetStatsRequest(),
                timeout=_deadline(timeout, self.timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise self._error(exc, index) from exc
        return stats_from_proto(response)


class AsyncClient:
    """An asyncio client of one or several Scheduler replicas (``target`` as
    for ``Client``), resuming broken streams as ``Client`` does.

    The ``grpc.aio`` twin of ``Client``, with the same methods as coroutines
    (``generate`` returns an async iterator). Create it inside the event loop
    that uses it; close it with ``await close()`` or ``async with``.
    ``tls`` and ``token`` as for ``Client``.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = None,
        resume: ResumePolicy | None = None,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        self.targets = parse_targets(target)
        self.target = self.targets[0]
        self.timeout = timeout
        self.resume = resume if resume is not None else ResumePolicy()
        self.num_resumes = 0
        self._metadata = _metadata(token)
        self._tls = tls is not None
        self._channels = [open_aio_channel(t, tls) for t in self.targets]
        self._stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self._channels]
        self._health = TargetHealth(len(self.targets))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channels; calls in flight are cancelled."""
        for channel in self._channels:
            await channel.close()

    def _error(self, exc: grpc.RpcError, target_index: int) -> PagedkvError:
        """The typed error of a call to ``targets[target_index]`` that failed."""
        return error_from_rpc(exc, target=self.targets[target_index], tls=self._tls)

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        n: int = 1,
        beam_width: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        logprobs: int | None = None,
        cache_salt: str = "",
        priority: int = 0,
        request_id: str = "",
        skip_text: bool = False,
        timeout: float | None = None,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """As ``Client.generate``, as an async generator (not a coroutine: use
        ``async for chunk in client.generate(...)``). To stop early, close it
        (``await stream.aclose()``, or ``contextlib.aclosing``): a stream
        merely dropped is closed, and its call cancelled, only once Python
        collects it."""
        request = generate_request(
            prompt,
            token_ids=token_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            n=n,
            beam_width=beam_width,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            min_tokens=min_tokens,
            logprobs=logprobs,
            cache_salt=cache_salt,
            priority=priority,
            request_id=request_id,
            skip_text=skip_text,
        )
        return self._stream(request, _deadline(timeout, self.timeout))

    def stream_request(
        self, request: scheduler_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[GenerateChunk, None]:
        """As ``generate``, for a ``GenerateRequest`` built by the caller (a
        front that maps another API onto the v1 contract): the same resume,
        errors and cancellation. The request is not checked here; the
        scheduler answers INVALID_ARGUMENT naming the field."""
        return self._stream(request, _deadline(timeout, self.timeout))

    async def _stream(
        self, request: scheduler_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[GenerateChunk, None]:
        resume = StreamResume(
            _with_request_id(request),
            first_target=self._health.pick(),
            num_targets=len(self.targets),
            policy=self.resume,
            timeout=timeout,
            health=self._health,
        )
        final = False
        while True:
            call = self._stubs[resume.target_index].Generate(
                resume.request, timeout=resume.timeout(), metadata=self._metadata
            )
            try:
                async for response in call:
                    chunk = chunk_from_proto(response)
                    resume.received(chunk)
                    final = final or chunk.is_final
                    yield chunk
                break
            except grpc.RpcError as exc:
                error = self._error(exc, resume.target_index)
                attempt = _next_attempt(resume, error)
                if attempt is None:
                    raise error from exc
                _log_attempt(attempt, error, self.targets[attempt.target_index])
            finally:
                call.cancel()  # a no-op once the call has ended
            if attempt.resumes:
                self.num_resumes += 1
            await asyncio.sleep(attempt.delay_s)
        if not final:
            raise IncompleteStreamError(grpc.StatusCode.UNKNOWN, "stream ended without usage")

    async def generate_text(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        n: int = 1,
        beam_width: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        logprobs: int | None = None,
        cache_salt: str = "",
        priority: int = 0,
        request_id: str = "",
        skip_text: bool = False,
        timeout: float | None = None,
    ) -> Completion:
        """As ``Client.generate_text``."""
        stream = self.generate(
            prompt,
            token_ids=token_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            n=n,
            beam_width=beam_width,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            min_tokens=min_tokens,
            logprobs=logprobs,
            cache_salt=cache_salt,
            priority=priority,
            request_id=request_id,
            skip_text=skip_text,
            timeout=timeout,
        )
        return Completion.from_chunks([chunk async for chunk in stream])

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """As ``Client.abort``."""
        request = scheduler_pb2.AbortRequest(request_id=request_id)
        aborted, errors = False, []
        for stub in self._stubs:
            try:
                response = await stub.Abort(
                    request, timeout=_deadline(timeout, self.timeout), metadata=self._metadata
                )
            except grpc.RpcError as exc:
                errors.append(exc)
                continue
            aborted = aborted or response.aborted
        if len(errors) == len(self._stubs):
            raise self._error(errors[0], 0) from errors[0]
        return aborted

    async def stats(self, *, target: str | None = None, timeout: float | None = None) -> Stats:
        """As ``Client.stats``."""
        index = _target_index(self.targets, target)
        stub = self._stubs[index]
        try:
            response = await stub.GetStats(
                scheduler_pb2.GetStatsRequest(),
                timeout=_deadline(timeout, self.timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise self._error(exc, index) from exc
        return stats_from_proto(response)
