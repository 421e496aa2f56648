"""``Client``: the blocking client of the Scheduler service.

Requests are built by ``generate_request`` (``pagedkv.client.options``,
which checks the options before any call); targets, resuming, chunks and
errors are ``ClientBase``'s and ``GenerateStream``'s (``pagedkv.client.core``,
shared with ``AsyncClient``). What is here is the blocking calling: a
``for`` over each call, ``time.sleep`` before a resumed one.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import grpc

from pagedkv.client.core import ClientBase
from pagedkv.client.options import GenerateOptions, generate_request
from pagedkv.client.stats import Stats, stats_from_proto
from pagedkv.client.types import Completion, GenerateChunk
from pagedkv.common.resume import ResumePolicy
from pagedkv.common.security import TlsConfig, open_channel
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only for the type checker


class Client(ClientBase):
    """A blocking client of one or several Scheduler replicas.

    ``target`` is "host:port" (a host alone: the scheduler's default port
    50051), a sequence of them, or one string of them separated by commas.
    ``targets`` holds them with their ports, ``target`` the first. Generate
    calls start on the targets in turn; a broken stream resumes on the next
    one as ``resume`` says (default ``ResumePolicy()``; see
    ``pagedkv.common.resume``), and ``num_resumes`` counts the calls made to
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
        super().__init__(target, timeout=timeout, resume=resume, tls=tls, token=token)
        self._channels = [open_channel(t, tls) for t in self.targets]
        self._stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self._channels]

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

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Generator[GenerateChunk, None, None]:
        """Streams the chunks of one generation, the last one carrying usage.

        Give exactly one of ``prompt`` (text, tokenized by the scheduler) and
        ``token_ids``; the options (``GenerateOptions``) are checked now
        (ValueError) and the call starts at the first ``next()``. The
        sampling options are those of ``SamplingParams`` in common.proto;
        None leaves a field to the scheduler's default. Lower ``priority``
        is more important; an empty ``request_id`` gets a uuid4 hex.
        ``skip_text``: token ids only, no text is made (every chunk's text
        is empty). ``stop``: stop strings (one string is one stop string);
        the text ends before the one that ends first (after it with
        ``include_stop_str_in_output``), and the sequence's last chunk names
        it (``SequenceChunk.stop_string``). A stream that breaks (its
        scheduler gone) continues on the next target, unless ``n`` > 1 or
        beam search. Raises a ``PagedkvError`` when the call fails, also
        after some chunks, and ``IncompleteStreamError`` when it ends
        without a final chunk. Closing the iterator early cancels the call.
        """
        return self._stream(generate_request(prompt, **options), timeout)

    def _stream(
        self, request: scheduler_pb2.GenerateRequest, timeout: float | None
    ) -> Generator[GenerateChunk, None, None]:
        stream = self._open_stream(request, timeout)
        while True:
            call = self._stubs[stream.target_index].Generate(
                stream.request, timeout=stream.timeout(), metadata=stream.metadata
            )
            try:
                for response in call:
                    yield stream.chunk(response)
                break
            except grpc.RpcError as exc:
                delay_s = stream.retry_delay(exc)
            finally:
                call.cancel()  # a no-op once the call has ended
            time.sleep(delay_s)
        stream.check_complete()

    def generate_text(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion:
        """Runs ``generate`` with the same arguments to the end and returns the
        accumulated result; raises as ``generate`` does."""
        return Completion.from_chunks(self.generate(prompt, timeout=timeout, **options))

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Aborts a live request on every target (its stream ends with a
        chunk finished ABORT). True if it was live on one; False if unknown
        or already finished everywhere. Idempotent. Targets that are
        unreachable are skipped; raises only when no target answered."""
        request = scheduler_pb2.AbortRequest(request_id=request_id)
        outcomes: list[scheduler_pb2.AbortResponse | grpc.RpcError] = []
        for stub in self._stubs:
            try:
                outcomes.append(
                    stub.Abort(request, timeout=self._deadline(timeout), metadata=self._metadata)
                )
            except grpc.RpcError as exc:
                outcomes.append(exc)
        return self._aborted(outcomes)

    def stats(
        self,
        *,
        target: str | None = None,
        timeout: float | None = None,
        reset_peak_used_blocks: bool = False,
    ) -> Stats:
        """A snapshot of one replica's load, executors and block-pool
        integrity: ``target`` (one of ``targets``; default: the first).
        ``reset_peak_used_blocks``: each executor's ``peak_used_blocks``
        starts over once answered (it then covers the time since the
        previous such call)."""
        index = self._target_index(target)
        try:
            response = self._stubs[index].GetStats(
                scheduler_pb2.GetStatsRequest(reset_peak_used_blocks=reset_peak_used_blocks),
                timeout=self._deadline(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise self._error(exc, index) from exc
        return stats_from_proto(response)
