"""Typed results of the Scheduler API's Generate, converted from the protos
in this file only (GetStats' snapshot is ``pagedkv.client.stats``).

Every value is a frozen dataclass holding tuples, so results can be shared and
hashed freely. ``None`` means "the server did not say" (an unfinished
sequence has no finish reason, a chunk before the last has no usage); empty
strings and tuples mean "nothing".
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from pagedkv.common.ids import RequestId
from pagedkv.v1 import scheduler_pb2


class FinishReason(str, enum.Enum):
    """Why a sequence or beam stopped (``FINISH_REASON_*`` without the prefix)."""

    LENGTH = "length"
    """Reached max_tokens or the model's max_model_len."""
    STOP = "stop"
    """Generated one of stop_token_ids, or its text reached a stop string (see
    ``SequenceChunk.stop_token_id`` and ``stop_string``)."""
    EOS = "eos"
    """Generated one of the model's EOS tokens."""
    ABORT = "abort"
    """Ended by the Abort RPC or a server shutdown."""
    ERROR = "error"
    """Ended by a server-side failure; the stream then fails with its status."""


_FINISH_REASONS: dict[int, FinishReason | None] = {
    scheduler_pb2.FINISH_REASON_UNSPECIFIED: None,
    scheduler_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    scheduler_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    scheduler_pb2.FINISH_REASON_EOS: FinishReason.EOS,
    scheduler_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    scheduler_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probabilities of one generated token, under the raw model distribution."""

    logprob: float
    """Of the chosen token."""
    top_token_ids: tuple[int, ...]
    """The most likely token ids, most likely first (empty with ``logprobs=0``)."""
    top_logprobs: tuple[float, ...]
    """Log-probabilities of ``top_token_ids``, same order and length."""


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """What one output sequence produced since the previous chunk."""

    index: int
    """Which sequence, ``0 <= index < n``."""
    token_ids: tuple[int, ...]
    """Tokens generated since this sequence's previous chunk."""
    text: str
    """Text delta; may lag ``token_ids`` when a character spans tokens. The
    concatenation of all deltas is the sequence's full text."""
    logprobs: tuple[TokenLogprob, ...]
    """One per ``token_ids`` entry when logprobs were asked for, else empty."""
    finish_reason: FinishReason | None
    """Set on the chunk that ends the sequence; None while it runs."""
    stop_token_id: int | None
    """With ``FinishReason.STOP``: the stop token that ended it."""
    error_message: str | None
    """With ``FinishReason.ERROR``: what failed, for humans."""
    stop_string: str | None = None
    """With ``FinishReason.STOP`` by a stop string: which one (then
    ``stop_token_id`` is None)."""


@dataclass(frozen=True, slots=True)
class Beam:
    """One finished beam of a beam search."""

    token_ids: tuple[int, ...]
    """All generated tokens of the beam (not the prompt)."""
    text: str
    cumulative_logprob: float
    """Sum of the raw log-probabilities of ``token_ids``; beams are ranked by it."""
    finish_reason: FinishReason | None
    """LENGTH, STOP or EOS; None only if the server left it unset."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request, from its final chunk."""

    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""
    completion_tokens: int
    """Generated tokens, summed over all sequences (or final beams)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request was placed, from its stream's first chunk."""

    executor: str
    """The address of the executor it was queued on."""
    hint: str
    """What became of a router's placement hint: "none" (there was none),
    "honoured", "not_held" or "draining" (the scheduler placed it itself)."""


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """One message of a Generate stream."""

    request_id: RequestId
    """The id in use (the scheduler's own if the request left it empty)."""
    sequences: tuple[SequenceChunk, ...]
    """Sequences with news since the previous chunk; the others are left out."""
    beams: tuple[Beam, ...]
    """Beam search only: the final beams, best first, on the final chunk."""
    usage: Usage | None
    """Set on the final chunk only."""
    placement: Placement | None = None
    """Set on the stream's first chunk only."""

    @property
    def is_final(self) -> bool:
        """True for the last chunk of the stream (the one with ``usage``)."""
        return self.usage is not None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole Generate stream, accumulated per sequence index.

    ``texts``, ``token_ids``, ``logprobs`` and ``finish_reasons`` are indexed by
    sequence index and cover every index the stream mentioned; they are empty
    for a beam search whose results are all in ``beams``.
    """

    request_id: RequestId
    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[TokenLogprob, ...], ...]
    """Per index; each empty unless logprobs were asked for."""
    finish_reasons: tuple[FinishReason | None, ...]
    """Per index; None for a sequence the stream never finished."""
    usage: Usage
    beams: tuple[Beam, ...]
    stop_strings: tuple[str | None, ...] = ()
    """Per index: the stop string that ended the sequence, or None."""

    @property
    def text(self) -> str:
        """The text of sequence 0 (of the best beam for a beam search)."""
        if self.texts:
            return self.texts[0]
        return self.beams[0].text if self.beams else ""

    @classmethod
    def from_chunks(cls, chunks: Iterable[GenerateChunk]) -> Completion:
        """Accumulates the chunks of one stream, in stream order.

        Raises ValueError when there are no chunks or none carries usage (the
        stream was cut short).
        """
        request_id: RequestId | None = None
        texts: dict[int, list[str]] = {}
        token_ids: dict[int, list[int]] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        finish_reasons: dict[int, FinishReason | None] = {}
        stop_strings: dict[int, str] = {}
        usage: Usage | None = None
        beams: tuple[Beam, ...] = ()
        for chunk in chunks:
            request_id = chunk.request_id
            for seq in chunk.sequences:
                texts.setdefault(seq.index, []).append(seq.text)
                token_ids.setdefault(seq.index, []).extend(seq.token_ids)
                logprobs.setdefault(seq.index, []).extend(seq.logprobs)
                finish_reasons[seq.index] = seq.finish_reason or finish_reasons.get(seq.index)
                if seq.stop_string is not None:
                    stop_strings[seq.index] = seq.stop_string
            beams = chunk.beams or beams
            usage = chunk.usage or usage
        if request_id is None or usage is None:
            raise ValueError("the stream ended before its final chunk (the one with usage)")
        indices = range(max(texts, default=-1) + 1)
        return cls(
            request_id=request_id,
            texts=tuple("".join(texts.get(i, ())) for i in indices),
            token_ids=tuple(tuple(token_ids.get(i, ())) for i in indices),
            logprobs=tuple(tuple(logprobs.get(i, ())) for i in indices),
            finish_reasons=tuple(finish_reasons.get(i) for i in indices),
            usage=usage,
            beams=beams,
            stop_strings=tuple(stop_strings.get(i) for i in indices),
        )


# --- proto -> types: the only place that reads response protos ---------------


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """The finish reason of a proto enum value; None for UNSPECIFIED.

    An enum value this SDK does not know (a newer server) maps to ERROR, so it
    never passes for a running sequence.
    """
    return _FINISH_REASONS.get(value, FinishReason.ERROR)


def _sequence_from_proto(out: scheduler_pb2.SequenceOutput) -> SequenceChunk:
    logprobs = out.logprobs
    return SequenceChunk(
        out.index,
        tuple(out.token_ids),
        out.text_delta,
        tuple(
            TokenLogprob(lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs))
            for lp in logprobs
        )
        if logprobs
        else (),
        _FINISH_REASONS.get(out.finish_reason, FinishReason.ERROR),
        out.stop_token_id if out.HasField("stop_token_id") else None,
        out.error_message or None,
        out.stop_string or None,
    )


def chunk_from_proto(msg: scheduler_pb2.GenerateResponse) -> GenerateChunk:
    """One Generate stream message as a ``GenerateChunk``. Called for every
    message of every stream: what a message does not carry (beams,
    logprobs, usage before the last one) costs nothing to skip."""
    outputs, beams = msg.outputs, msg.beams
    if len(outputs) == 1:
        sequences: tuple[SequenceChunk, ...] = (_sequence_from_proto(outputs[0]),)
    else:
        sequences = tuple(_sequence_from_proto(out) for out in outputs)
    return GenerateChunk(
        RequestId(msg.request_id),
        sequences,
        tuple(
            Beam(
                token_ids=tuple(beam.token_ids),
                text=beam.text,
                cumulative_logprob=beam.cumulative_logprob,
                finish_reason=finish_reason_from_proto(beam.finish_reason),
            )
            for beam in beams
        )
        if beams
        else (),
        Usage(
            prompt_tokens=msg.usage.prompt_tokens,
            cached_prompt_tokens=msg.usage.cached_prompt_tokens,
            completion_tokens=msg.usage.completion_tokens,
        )
        if msg.HasField("usage")
        else None,
        Placement(
            executor=msg.placement.executor,
            hint=scheduler_pb2.PlacementHint.Name(msg.placement.hint)
            .removeprefix("PLACEMENT_HINT_")
            .lower(),
        )
        if msg.HasField("placement")
        else None,
    )
