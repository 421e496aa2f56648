"""A Generate call as the scheduler tracks it: one ``Generation`` with ``n``
output ``Sequence``s, each a block-core ``Request`` on one executor.

Sequences move WAITING -> RUNNING -> FINISHED, and RUNNING -> WAITING again
when preempted or when their executor is lost (recompute: their KV is
recomputed from their whole history). The generation owns the queue its
Generate stream reads (chunks.py): news marks, whose messages it makes from
its sequences' pending outputs when the stream reads them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedkv.common.ids import SeqId
from pagedkv.common.text import IncrementalDetokenizer, TextTokenizer
from pagedkv.scheduler.beam import BeamSearch
from pagedkv.scheduler.chunks import ChunkQueue
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.stop_strings import StopMatcher
from pagedkv.v1 import common_pb2, scheduler_pb2

FinishReason = scheduler_pb2.FinishReason
_LENGTH = FinishReason.FINISH_REASON_LENGTH


class SequenceState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_FINISHED = SequenceState.FINISHED


@dataclass(slots=True)
class ExecutorRow:
    """A sequence's state on its executor, from admission to release.

    ``table_lengths``: its block tables' lengths (per group) as the executor
    has them; None until the executor knows it (the next step sends it as a
    new request). ``inflight_samples``: samples asked for in steps sent but
    not yet applied (async stepping). ``pending_on_executor``: the executor
    holds a sample for a later step to continue from. ``token_unsent``: a
    beam's token, chosen here, that the executor does not have yet.
    """

    row: int
    table_lengths: list[int] | None = None
    inflight_samples: int = 0
    pending_on_executor: bool = False
    token_unsent: bool = False


@dataclass(eq=False)
class Sequence:
    """One output sequence; ``request`` holds its tokens and computed count."""

    generation: Generation
    index: int
    request: Request
    state: SequenceState = SequenceState.WAITING
    executor: str | None = None  # address of the executor it lives on
    finish_reason: int = FinishReason.FINISH_REASON_UNSPECIFIED
    stop_token_id: int | None = None
    error_message: str = ""  # with FINISH_REASON_ERROR: what failed, for humans
    # Output since its stream's last message, and logprobs per output token.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[scheduler_pb2.TokenLogprobs] = field(default_factory=list)
    # Its text: made lazily from pending_token_ids by the detokenizer when
    # its stream makes a message, or, with stop strings, eagerly by the stop
    # matcher (which then owns the detokenizer) into pending_text.
    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopMatcher | None = None
    pending_text: str = ""
    admitted: bool = False  # admitted once (cached prompt tokens are counted then)
    finish_reported: bool = False  # a message has carried its finish
    # Its state on its executor while it holds a row there (see ExecutorRow);
    # None: it holds none. Replaced, never reset, so that responses to steps
    # sent before a release are told apart (``ScheduledStep.sampled``).
    placed: ExecutorRow | None = None
    # Beam search: the cumulative logprob and this round's candidates
    # (logprob, token id).
    cum_logprob: float = 0.0
    candidates: list[tuple[float, int]] | None = None
    # Tokens (prompt and outputs) at which it stops (LENGTH): its prompt plus
    # max_tokens, at most max_model_len; set by the scheduler it joins.
    max_num_tokens: int = 0

    @property
    def row(self) -> int | None:
        """Its executor row while it holds one."""
        placed = self.placed
        return None if placed is None else placed.row

    def detach(self) -> ExecutorRow | None:
        """Forgets its executor state (one place for every release and
        evacuation); returns the record it had. A beam's candidates go
        with it: a preempted or moved beam samples them again once its KV
        is recomputed, and its generation's round waits for it."""
        placed, self.placed = self.placed, None
        self.candidates = None
        return placed

    @property
    def seq_id(self) -> SeqId:
        """Its id in the block core and on the executor (``Request.seq_id``)."""
        return self.request.seq_id

    @property
    def finished(self) -> bool:
        return self.state is SequenceState.FINISHED

    def stop_reason(self, token: int) -> int | None:
        """The one stop check of a sampled token just appended: its finish
        reason, or None when the sequence goes on. Stop strings are the
        text's (``push_text``), looked for after it."""
        reason = self.generation.stop_reasons.get(token)
        if reason is None and len(self.request.token_ids) >= self.max_num_tokens:
            return _LENGTH
        return reason

    def push_text(self, token: int) -> str | None:
        """With stop strings (``stop_matcher``), the text check of a sampled
        token just appended: pushes it through the matcher, adds the text it
        releases to ``pending_text`` and returns the stop string it
        completes, or None when the sequence goes on (or has no matcher).
        Before ``min_tokens`` outputs, no stop string is looked for."""
        matcher = self.stop_matcher
        if matcher is None:
            return None
        may_stop = self.request.num_output_tokens >= self.generation.sampling.min_tokens
        released = matcher.push((token,), may_stop)
        if released.text:
            self.pending_text += released.text
        return released.stop

    def stop_index(self, tokens: list[int]) -> tuple[int, int | None]:
        """``stop_reason`` of each of ``tokens`` appended in turn, at once
        (nothing is appended): the index of the first that stops the
        sequence and its reason, or ``(len(tokens), None)``."""
        # The token that reaches max_num_tokens stops it by length (the first
        # always checks, as stop_reason would after appending it).
        at_length = max(self.max_num_tokens - len(self.request.token_ids) - 1, 0)
        stops = self.generation.stop_reasons
        if stops and not stops.keys().isdisjoint(tokens):
            for i, token in enumerate(tokens[: at_length + 1]):
                if token in stops:
                    return i, stops[token]
        if at_length < len(tokens):
            return at_length, _LENGTH
        return len(tokens), None

    def finish(
        self, reason: int, stop_token_id: int | None = None, error_message: str = ""
    ) -> None:
        self.state = SequenceState.FINISHED
        self.finish_reason = reason
        self.stop_token_id = stop_token_id
        self.error_message = error_message


@dataclass(eq=False)
class Generation:
    """One Generate call: its params, sequences and response queue.

    ``prompt_token_ids`` is the prompt alone. A resumed call's sequence starts
    with the resumed tokens already in its request, after the prompt, as
    outputs: they count toward max_tokens and ``usage.completion_tokens``
    but were delivered by the broken stream, so no chunk carries them.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    max_tokens: int
    n: int
    priority: int
    cache_salt: str
    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    arrival: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    chunks: ChunkQueue = field(init=False)  # what its stream reads (chunks.py)
    num_cached_prompt_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    forked: bool = False  # the other n - 1 sequences were forked from the first
    done: bool = False  # its last news or message is queued
    final_queued: bool = False  # the final news is queued: the message with usage
    final_taken: bool = False  # the message with usage was made
    window_tokens: int = 0  # a plain generation's tokens of its last decode window
    beam: BeamSearch | None = None  # beam search (beam_width >= 2)
    tokenizer: TextTokenizer | None = None  # the text of beams and sequences; None: none
    reserved_rows: list[int] = field(default_factory=list)  # rows kept for its forks
    # The scheduler's own serial number of this call: sequences are named
    # from it, never from the client's request_id (which is free text).
    key: int = 0
    num_seq_ids: int = 0
    # Where the generation was queued; sent on its first chunk, then None.
    placement: scheduler_pb2.Placement | None = None
    # Set from the fields above when made: each stop token's finish reason
    # (see ``stop_token_reason``), and whether every sample is plain (no
    # beam search, no logprobs, one sequence: the short path of step_outputs).
    stop_reasons: dict[int, int] = field(init=False)
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        self.chunks = ChunkQueue(self.take_response, self.request_id)
        eos, stop = FinishReason.FINISH_REASON_EOS, FinishReason.FINISH_REASON_STOP
        self.stop_reasons = {token: eos for token in self.eos_token_ids}
        self.stop_reasons.update({token: stop for token in self.stop_token_ids})
        sampling = self.sampling
        self.plain = (
            self.beam is None
            and self.n == 1
            and not sampling.HasField("logprobs")
            and not sampling.stop
        )

    def new_seq_id(self) -> str:
        """A name for a new sequence of this generation (its ``seq_id`` in
        the block core and on the executor), unique in the scheduler."""
        seq_id = f"{self.key}.{self.num_seq_ids}"
        self.num_seq_ids += 1
        return seq_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def stop_token_reason(self, token: int) -> int | None:
        """STOP for a stop token, EOS for an EOS token, else None."""
        return self.stop_reasons.get(token)

    def sampling_for(self, index: int) -> common_pb2.SamplingParams:
        """Sequence ``index``'s executor sampling: a distinct seed per sequence."""
        params = common_pb2.SamplingParams()
        params.CopyFrom(self.sampling)
        if self.beam is not None:  # the scheduler picks tokens from the top logprobs
            params.temperature = 0.0
            params.logprobs = self.beam.num_candidates
            params.ClearField("seed")
        elif index and params.HasField("seed"):
            params.seed = (params.seed + index) % 2**64
        return params

    def flush(self) -> None:
        """Marks the generation's news for its stream (the message is made
        when the stream reads it, ``take_response``); the final news (every
        sequence finished: the message with usage) once. The step loop
        calls it once per step for each generation with a sample, so it
        costs a check of each sequence and a mark."""
        if self.done:
            return
        if self.beam is not None:
            if all(s.finished for s in self.sequences):
                response = scheduler_pb2.GenerateResponse(request_id=self.request_id)
                self._finish_beams(response)
            return
        all_finished = True
        news = False
        for seq in self.sequences:
            if seq.state is not _FINISHED:
                all_finished = False
                if seq.pending_token_ids:
                    news = True
            elif seq.pending_token_ids or not seq.finish_reported:
                news = True
        if all_finished:
            self.done = self.final_queued = True
        elif not news:
            return
        self.chunks.put_news(all_finished)

    def flush_now(self) -> None:
        """As ``flush``, the message made now: the caller is about to change
        the sequences' state in ways the stream must not see (a hand-back
        finishes them with an error after the news it sends)."""
        if self.done or self.beam is not None:
            self.flush()
            return
        if all(seq.state is _FINISHED for seq in self.sequences):
            self.done = self.final_queued = True
        self.chunks.drop_news()  # the message made now holds that news
        response = self.take_response()
        if response is not None:
            self.chunks.put_nowait(response)

    def take_response(self) -> scheduler_pb2.GenerateResponse | None:
        """The news since the stream's last message, as one message (None:
        no news): each sequence's new tokens, logprobs and text delta (its
        detokenizer runs on the tokens now), its finish once; the usage once
        the final news is queued; the placement on the first message."""
        response = None
        for seq in self.sequences:
            tokens = seq.pending_token_ids
            finishing = seq.state is _FINISHED and not seq.finish_reported
            if not tokens and not finishing:
                continue
            if response is None:
                response = scheduler_pb2.GenerateResponse(request_id=self.request_id)
            text = seq.pending_text
            stop_string = ""
            matcher = seq.stop_matcher
            if finishing and matcher is not None:
                # Held text goes out, unless a stop string ended it.
                text += matcher.flush()
                stop_string = matcher.stopped or ""
            detokenizer = seq.detokenizer
            if detokenizer is not None:
                if tokens:
                    text += detokenizer.push(tokens)
                if finishing:
                    text += detokenizer.flush()
            output = response.outputs.add(
                index=seq.index, token_ids=tokens, text_delta=text, logprobs=seq.pending_logprobs
            )
            if tokens:
                seq.pending_token_ids = []
            if seq.pending_text:
                seq.pending_text = ""
            if seq.pending_logprobs:
                seq.pending_logprobs = []
            if finishing:
                seq.finish_reported = True
                output.finish_reason = seq.finish_reason  # type: ignore[assignment]
                if seq.stop_token_id is not None:
                    output.stop_token_id = seq.stop_token_id
                output.error_message = seq.error_message
                output.stop_string = stop_string
        if self.final_queued and not self.final_taken:
            self.final_taken = True
            if response is None:
                response = scheduler_pb2.GenerateResponse(request_id=self.request_id)
            usage = response.usage
            usage.prompt_tokens = self.num_prompt_tokens
            # A resumed sequence's cache hit can reach into its resumed tokens.
            usage.cached_prompt_tokens = min(self.num_cached_prompt_tokens, self.num_prompt_tokens)
            usage.completion_tokens = sum(s.request.num_output_tokens for s in self.sequences)
        placement = self.placement
        if response is not None and placement is not None:
            self.placement = None
            response.placement.CopyFrom(placement)
        return response

    def _take_placement(self) -> scheduler_pb2.Placement | None:
        """The placement, for the first message only."""
        placement, self.placement = self.placement, None
        return placement

    def _send(self, response: scheduler_pb2.GenerateResponse) -> None:
        """Queues a made message; the first one carries the placement."""
        placement = self._take_placement()
        if placement is not None:
            response.placement.CopyFrom(placement)
        self.chunks.put_nowait(response)

    def _finish_beams(self, response: scheduler_pb2.GenerateResponse) -> None:
        """The final chunk of a beam search: the best beams and usage (a
        failed search: one output saying what failed)."""
        assert self.beam is not None
        failed = [s for s in self.sequences if s.finish_reason == FinishReason.FINISH_REASON_ERROR]
        best = [] if failed else self.beam.best()
        if failed:
            response.outputs.add(
                finish_reason=FinishReason.FINISH_REASON_ERROR,
                error_message=failed[0].error_message,
            )
        for beam in best:
            text = self.tokenizer.decode(beam.token_ids) if self.tokenizer else ""
            response.beams.add(
                token_ids=beam.token_ids,
                text=text,
                cumulative_logprob=beam.score,
                finish_reason=beam.reason,
            )
        response.usage.prompt_tokens = self.num_prompt_tokens
        response.usage.cached_prompt_tokens = self.num_cached_prompt_tokens
        response.usage.completion_tokens = sum(len(b.token_ids) for b in best)
        self.done = True
        self._send(response)
