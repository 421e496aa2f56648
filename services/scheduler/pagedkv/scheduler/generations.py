"""The live generations and how each ends: finished (its last chunk
queued), aborted, failed with an error, or handed back to the SDK to be
resumed elsewhere. Ending one releases its sequences on their executors
through the registry (``Executors.release``)."""

from __future__ import annotations

import time

from pagedkv.common.errors import ServiceError, Unavailable
from pagedkv.common.logging import get_logger
from pagedkv.scheduler.executors import Executors
from pagedkv.scheduler.internal_errors import InternalErrors
from pagedkv.scheduler.metrics import SchedulerMetrics
from pagedkv.scheduler.sequence import FinishReason, Generation

log = get_logger(__name__)


class Generations:
    """The live generations by request id (``live``). Only its methods add
    or remove one; a generation's chunks are queued by ``Generation.flush``."""

    def __init__(
        self,
        executors: Executors,
        errors: InternalErrors,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.executors = executors
        self.errors = errors
        self.metrics = metrics
        self.live: dict[str, Generation] = {}

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.live

    def add(self, generation: Generation) -> None:
        """A generation just queued on its executor is live."""
        self.live[generation.request_id] = generation

    def retire(self, generation: Generation) -> None:
        """A generation whose final chunk was just queued (``flush``) is
        forgotten and counted as finished."""
        if generation.done and self.live.get(generation.request_id) is generation:
            del self.live[generation.request_id]
            self._count_finished(generation)

    def abort(self, request_id: str) -> bool:
        """Ends a live generation with FINISH_REASON_ABORT and frees its blocks."""
        generation = self.live.pop(request_id, None)
        if generation is None:
            return False
        ended = [seq for seq in generation.sequences if not seq.finished]
        for seq in ended:  # all finished first: the last release returns reserved rows
            seq.finish(FinishReason.FINISH_REASON_ABORT)
        for seq in ended:
            self.executors.release(seq, "abort", request_id)
        self.end(generation)
        return True

    def end(self, generation: Generation, error: ServiceError | None = None) -> None:
        """Queues a finished generation's last chunk (then ``error``, the
        status its stream ends with) and forgets it."""
        try:
            generation.flush()
        except Exception as exc:
            error = error or self.errors.report(exc, "flush", request_id=generation.request_id)
        if error is not None:
            generation.done = True
            generation.chunks.put_nowait(error)
        if self.live.get(generation.request_id) is generation:
            del self.live[generation.request_id]
        self._count_finished(generation)

    def fail(self, generation: Generation, error: ServiceError) -> None:
        """Ends a generation with FINISH_REASON_ERROR (its blocks released)
        and its stream with ``error``. A release that raises leaves its
        executor to be resynced."""
        if generation.done:
            return
        self._finish_and_release(generation, str(error))
        self.end(generation, error)

    def hand_back(self, generation: Generation, error: Unavailable) -> None:
        """Ends a generation that another replica can continue (this
        scheduler is stopping, or in a cluster its last executor went to
        another member) as a broken stream: its news so far in a chunk that
        is not final, its blocks released, then ``error`` (UNAVAILABLE), so
        the SDK resumes it elsewhere with the tokens received. A final chunk
        would tell the SDK the request ended here. n > 1 and beam searches
        cannot be resumed: they fail (``fail``)."""
        if generation.done:
            return
        if generation.n > 1 or generation.beam is not None:
            self.fail(generation, error)
            return
        if all(seq.finished for seq in generation.sequences):
            self.end(generation)  # it has finished: its final chunk goes out
            return
        try:
            generation.flush_now()  # not final: its sequence has not finished
        except Exception as exc:
            self.fail(
                generation, self.errors.report(exc, "flush", request_id=generation.request_id)
            )
            return
        self._finish_and_release(generation, str(error))
        generation.done = True  # no final chunk after the news
        generation.chunks.put_nowait(error)
        if self.live.get(generation.request_id) is generation:
            del self.live[generation.request_id]
        self._count_finished(generation)

    def _finish_and_release(self, generation: Generation, why: str) -> None:
        """Finishes the generation's unfinished sequences with
        FINISH_REASON_ERROR and releases every sequence's blocks."""
        for seq in generation.sequences:
            if not seq.finished:
                seq.finish(FinishReason.FINISH_REASON_ERROR, error_message=why)
        for seq in generation.sequences:
            self.executors.release(seq, "release", generation.request_id)

    def _count_finished(self, generation: Generation) -> None:
        reasons = sorted(
            {
                FinishReason.Name(s.finish_reason).removeprefix("FINISH_REASON_").lower()
                for s in generation.sequences
            }
        )
        log.info(
            "request finished",
            request_id=generation.request_id,
            finish_reasons=reasons,
            completion_tokens=sum(s.request.num_output_tokens for s in generation.sequences),
            cached_prompt_tokens=generation.num_cached_prompt_tokens,
            seconds=round(time.monotonic() - generation.arrival, 4),
        )
        if self.metrics is None:
            return
        for seq in generation.sequences:
            name = FinishReason.Name(seq.finish_reason).removeprefix("FINISH_REASON_").lower()
            self.metrics.count_finished(name)
        self.metrics.count_tokens(
            prompt=0, generated=sum(s.request.num_output_tokens for s in generation.sequences)
        )
