"""A Generate call as the scheduler tracks it: one ``Generation`` with ``n``
output ``Sequence``s, each a block-core ``Request`` on one executor.

Sequences move WAITING -> RUNNING -> FINISHED, and RUNNING -> WAITING again
when preempted or when their executor is lost (recompute: their KV is
recomputed from their whole history). The generation owns the queue of
response chunks its Generate stream reads.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedkv.common.ids import SeqId
from pagedkv.common.text import IncrementalDetokenizer, TextTokenizer
from pagedkv.scheduler.beam import BeamSearch
from pagedkv.scheduler.chunks import ChunkQueue, PendingChunk, PendingOutput
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
    # Output since the last chunk, and logprobs per output token.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[scheduler_pb2.TokenLogprobs] = field(default_factory=list)
    # Its text: made lazily from pending_token_ids by the detokenizer when
    # its stream reads a chunk, or, with stop strings, eagerly by the stop
    # matcher (which then owns the detokenizer) into pending_text.
    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopMatcher | None = None
    pending_text: str = ""
    admitted: bool = False  # admitted once (cached prompt tokens are counted then)
    finish_reported: bool = False  # its finishing chunk was queued
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
    chunks: ChunkQueue = field(default_factory=ChunkQueue)
    num_cached_prompt_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    forked: bool = False  # the other n - 1 sequences were forked from the first
    done: bool = False
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
        """Queues one chunk with every sequence's news; the final one (with
        usage) once every sequence has finished. The chunk's message and text
        are made when its stream reads it (see chunks.py)."""
        if self.done:
            return
        if self.beam is not None:
            if all(s.finished for s in self.sequences):
                response = scheduler_pb2.GenerateResponse(request_id=self.request_id)
                self._finish_beams(response)
            return
        all_finished = True
        outputs: list[PendingOutput] = []
        for seq in self.sequences:
            finished = seq.state is _FINISHED
            if not finished:
                all_finished = False
            tokens = seq.pending_token_ids
            matcher = seq.stop_matcher
            if finished and not seq.finish_reported:
                seq.finish_reported = True
                stop_string = ""
                if matcher is not None:  # held text goes out, unless a stop string ended it
                    seq.pending_text += matcher.flush()
                    stop_string = matcher.stopped or ""
                output = PendingOutput(
                    seq.index,
                    tokens,
                    seq.pending_logprobs,
                    seq.detokenizer,
                    seq.finish_reason,
                    seq.stop_token_id,
                    seq.error_message,
                    seq.pending_text,
                    stop_string,
                )
            elif tokens:
                output = PendingOutput(
                    seq.index, tokens, seq.pending_logprobs, seq.detokenizer, text=seq.pending_text
                )
            else:
                continue
            outputs.append(output)
            seq.pending_token_ids = []
            if seq.pending_text:
                seq.pending_text = ""
            if seq.pending_logprobs:
                seq.pending_logprobs = []
        usage = None
        if all_finished:
            usage = scheduler_pb2.Usage(
                prompt_tokens=self.num_prompt_tokens,
                # A resumed sequence's cache hit can reach into its resumed tokens.
                cached_prompt_tokens=min(self.num_cached_prompt_tokens, self.num_prompt_tokens),
                completion_tokens=sum(s.request.num_output_tokens for s in self.sequences),
            )
            self.done = True
        elif not outputs:
            return
        placement = None if self.placement is None else self._take_placement()
        self.chunks.put_nowait(PendingChunk(self.request_id, outputs, usage, placement))

    def _take_placement(self) -> scheduler_pb2.Placement | None:
        """The placement, for the first chunk only."""
        placement, self.placement = self.placement, None
        return placement

    def _send(self, response: scheduler_pb2.GenerateResponse) -> None:
        """Queues a chunk; the first one carries the placement."""
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
