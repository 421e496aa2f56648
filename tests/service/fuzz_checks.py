"""What the fuzz suite (``test_fuzz.py``) accepts from the Scheduler API: the
status codes each operation may end with, what a Generate stream must look
like, and what a burst's greedy outputs must agree on. Every check returns
the problems it found as sentences (empty: all good), so that one failure
report lists them all.

Whether two calls could have been live together is judged from the
client's view: a call is live on the server only within the time between
starting it and seeing its end, and a call the client cancelled or that
passed its deadline may stay live a little after that (its end reaches the
server later), so those count as live until the end of the burst.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import grpc

from pagedkv.v1 import scheduler_pb2
from tests.service.fuzz_ops import (
    EOS_TOKEN_ID,
    MAX_REQUEST_ID_BYTES,
    Abort,
    Generate,
    Operation,
    Stats,
)

FinishReason = scheduler_pb2.FinishReason
Code = grpc.StatusCode


@dataclass
class Outcome:
    """How one operation ended, as the client saw it. ``code`` is OK for a
    call that succeeded; ``cancelled``: the client cancelled it."""

    operation: Operation
    start: float
    end: float = math.inf
    code: grpc.StatusCode = Code.OK
    details: str = ""
    chunks: list[scheduler_pb2.GenerateResponse] = field(default_factory=list)
    cancelled: bool = False
    aborted: bool | None = None
    stats: scheduler_pb2.GetStatsResponse | None = None

    @property
    def live_until(self) -> float:
        if self.cancelled or self.code == Code.DEADLINE_EXCEEDED:
            return math.inf
        return self.end

    def overlaps(self, other: Outcome) -> bool:
        return self.start < other.live_until and other.start < self.live_until

    def summary(self) -> str:
        """One line: the code and, for a stream, its chunks and finish reasons."""
        text = str(self.code.name) + (f" {self.details[:200]!r}" if self.details else "")
        if isinstance(self.operation, Generate):
            reasons = [
                FinishReason.Name(o.finish_reason).removeprefix("FINISH_REASON_")
                for chunk in self.chunks
                for o in chunk.outputs
                if o.finish_reason
            ]
            final = self.chunks[-1] if self.chunks else None
            usage = final is not None and final.HasField("usage")
            text += f", {len(self.chunks)} chunks, finished {reasons}, usage {usage}"
            if self.cancelled:
                text += ", cancelled by the client"
        if self.aborted is not None:
            text += f", aborted={self.aborted}"
        return text


REFUSALS = (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.ALREADY_EXISTS)


def live_twins(outcome: Outcome, outcomes: list[Outcome]) -> list[Outcome]:
    """The Generate calls with the same non-empty id as ``outcome`` that
    could have been live at the same time (not refused, overlapping)."""
    request_id = outcome.operation.request_id  # type: ignore[union-attr]
    return [
        other
        for other in outcomes
        if other is not outcome
        and isinstance(other.operation, Generate)
        and request_id
        and other.operation.request_id == request_id
        and other.code not in REFUSALS
        and other.overlaps(outcome)
    ]


def check_status(outcome: Outcome, outcomes: list[Outcome]) -> list[str]:
    """The status code of a Generate call."""
    op = outcome.operation
    assert isinstance(op, Generate)
    refusals = []  # (code, field) the request must be refused with
    if op.id_too_long:
        refusals.append((Code.INVALID_ARGUMENT, "request_id"))
    if op.prompt_too_big:
        refusals.append((Code.RESOURCE_EXHAUSTED, "prompt"))
    code, details = outcome.code, outcome.details
    problems = []
    if code == Code.OK:
        if refusals:
            problems.append(f"accepted, expected {refusals[0][0].name} {refusals[0][1]!r}")
    elif code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED):
        if not any(code == c and details.startswith(f) for c, f in refusals):
            problems.append(f"refused with {code.name} {details!r}; expected {refusals or 'OK'}")
    elif code == Code.ALREADY_EXISTS:
        if op.id_too_long:  # an over-long id is never live
            problems.append(f"refused with ALREADY_EXISTS {details!r}; expected {refusals}")
        elif not details.startswith("request_id"):
            problems.append(f"ALREADY_EXISTS does not name request_id: {details!r}")
        elif not live_twins(outcome, outcomes):
            problems.append("ALREADY_EXISTS, but no call with its id could have been live")
    elif code == Code.DEADLINE_EXCEEDED:
        if op.deadline_s is None:
            problems.append("no end within the suite's generous bound (a hung stream)")
    elif code == Code.CANCELLED:
        if not outcome.cancelled:
            problems.append(f"CANCELLED, but the client did not cancel: {details!r}")
    else:
        problems.append(f"unexpected status {code.name}: {details!r}")
    return problems


def check_stream(outcome: Outcome, outcomes: list[Outcome]) -> list[str]:
    """The chunks of a Generate stream, whatever its status."""
    op = outcome.operation
    assert isinstance(op, Generate)
    chunks = outcome.chunks
    if not chunks:
        return ["ended OK without any chunk"] if outcome.code == Code.OK else []
    problems = []
    ids = {chunk.request_id for chunk in chunks}
    if ids != {op.request_id} and not (op.request_id == "" and len(ids) == 1 and "" not in ids):
        problems.append(f"chunks carry request ids {sorted(ids)!r}")
    usage_at = [i for i, chunk in enumerate(chunks) if chunk.HasField("usage")]
    if usage_at and usage_at[0] != len(chunks) - 1:
        problems.append(f"chunk {usage_at[0]} carries usage but {len(chunks)} chunks came")
    if outcome.code == Code.OK and not usage_at:
        problems.append("ended OK without a chunk carrying usage")
    aborted = any(
        other.operation.request_id == op.request_id and other.start < outcome.live_until
        for other in outcomes
        if isinstance(other.operation, Abort) and other.aborted
    )
    if op.beam_width:
        return problems + check_beams(op, chunks, aborted, bool(usage_at))
    return problems + check_sequences(op, chunks, aborted, bool(usage_at))


def text_of(tokens: list[int]) -> str:
    """What the tiny model's tokenizer decodes ``tokens`` to: their bytes
    (special tokens skipped), invalid UTF-8 replaced by U+FFFD."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def ends(op: Generate) -> set[int]:
    """Tokens that end a sequence."""
    return set(op.stop_token_ids) | (set() if op.ignore_eos else {EOS_TOKEN_ID})


def check_finish(op: Generate, tokens: list[int], reason: int, aborted: bool) -> list[str]:
    """A finished sequence's (or beam's) finish reason against its tokens."""
    name = FinishReason.Name(reason).removeprefix("FINISH_REASON_")
    if any(token in ends(op) for token in tokens[:-1]):
        return [f"{name} after an ending token: {tokens}"]
    last = tokens[-1] if tokens else None
    if len(tokens) > op.max_tokens:
        return [f"{len(tokens)} tokens > max_tokens {op.max_tokens}"]
    if reason == FinishReason.FINISH_REASON_LENGTH:
        ok = len(tokens) == op.max_tokens
    elif reason == FinishReason.FINISH_REASON_STOP:
        ok = last in op.stop_token_ids
    elif reason == FinishReason.FINISH_REASON_EOS:
        ok = last == EOS_TOKEN_ID and not op.ignore_eos
    elif reason == FinishReason.FINISH_REASON_ABORT:
        ok = aborted and last not in ends(op)
    else:
        ok = False
    if last in ends(op) and len(tokens) < op.max_tokens:
        ok = ok and reason in (FinishReason.FINISH_REASON_STOP, FinishReason.FINISH_REASON_EOS)
    return [] if ok else [f"finish reason {name} with {len(tokens)} tokens ending in {last}"]


def check_sequences(
    op: Generate, chunks: list[scheduler_pb2.GenerateResponse], aborted: bool, complete: bool
) -> list[str]:
    problems = []
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    reasons: dict[int, int] = {}
    for chunk in chunks:
        if chunk.beams:
            problems.append("beams in a stream without beam search")
        for output in chunk.outputs:
            i = output.index
            if i >= op.n:
                problems.append(f"sequence index {i} >= n {op.n}")
            if i in reasons:
                problems.append(f"sequence {i} has news after its finish")
            tokens.setdefault(i, []).extend(output.token_ids)
            texts[i] = texts.get(i, "") + output.text_delta
            problems += check_logprobs(op, output)
            if output.finish_reason:
                reasons[i] = output.finish_reason
                if output.finish_reason == FinishReason.FINISH_REASON_STOP and (
                    not output.HasField("stop_token_id") or tokens[i][-1:] != [output.stop_token_id]
                ):
                    problems.append(f"sequence {i}: STOP without its stop_token_id")
    for i, reason in reasons.items():
        problems += [f"sequence {i}: {p}" for p in check_finish(op, tokens[i], reason, aborted)]
        expected = text_of(tokens[i])
        if texts[i] != expected:
            problems.append(f"sequence {i}: text {texts[i]!r} is not its tokens' {expected!r}")
    if complete:
        if sorted(reasons) != list(range(op.n)):
            problems.append(f"final chunk, but only sequences {sorted(reasons)} finished")
        usage = chunks[-1].usage
        if usage.prompt_tokens != op.length:
            problems.append(f"usage.prompt_tokens {usage.prompt_tokens} != {op.length}")
        if usage.cached_prompt_tokens > usage.prompt_tokens:
            problems.append(f"usage.cached_prompt_tokens {usage.cached_prompt_tokens} > prompt")
        streamed = sum(len(t) for t in tokens.values())
        if usage.completion_tokens != streamed:
            problems.append(f"usage.completion_tokens {usage.completion_tokens} != {streamed}")
    return problems


def check_logprobs(op: Generate, output: scheduler_pb2.SequenceOutput) -> list[str]:
    if op.logprobs is None:
        return ["logprobs that were not asked for"] if output.logprobs else []
    if len(output.logprobs) != len(output.token_ids):
        return [f"{len(output.logprobs)} logprobs for {len(output.token_ids)} tokens"]
    for entry in output.logprobs:
        top = list(entry.top_logprobs)
        if len(entry.top_token_ids) != op.logprobs or len(top) != op.logprobs:
            return [f"{len(entry.top_token_ids)} top logprobs, asked for {op.logprobs}"]
        if not entry.logprob <= 1e-4 or top != sorted(top, reverse=True):
            return [f"bad logprobs {entry}"]
        if top and entry.logprob > top[0] + 1e-4:
            return [f"chosen logprob {entry.logprob} above the top one {top[0]}"]
    return []


def check_beams(
    op: Generate, chunks: list[scheduler_pb2.GenerateResponse], aborted: bool, complete: bool
) -> list[str]:
    problems = []
    if any(chunk.outputs for chunk in chunks):
        problems.append("sequence outputs in a beam search stream")
    if not complete:
        return problems
    final = chunks[-1]
    beams = list(final.beams)
    if len(beams) > op.beam_width or (len(beams) < op.beam_width and not aborted):
        problems.append(f"{len(beams)} beams for beam_width {op.beam_width}")
    scores = [beam.cumulative_logprob for beam in beams]
    if scores != sorted(scores, reverse=True):
        problems.append(f"beams not best first: {scores}")
    for k, beam in enumerate(beams):
        tokens = list(beam.token_ids)
        if not tokens:
            problems.append(f"beam {k} is empty")
            continue
        if beam.finish_reason == FinishReason.FINISH_REASON_ABORT:
            problems.append(f"beam {k} finished ABORT (a final beam ends LENGTH, STOP or EOS)")
            continue
        problems += [f"beam {k}: {p}" for p in check_finish(op, tokens, beam.finish_reason, False)]
        if beam.text != text_of(tokens):
            problems.append(f"beam {k}: text {beam.text!r} is not its tokens' {text_of(tokens)!r}")
    if final.usage.completion_tokens != sum(len(beam.token_ids) for beam in beams):
        problems.append(f"usage.completion_tokens {final.usage.completion_tokens} != beams'")
    return problems


def check_abort(outcome: Outcome, outcomes: list[Outcome]) -> list[str]:
    op = outcome.operation
    assert isinstance(op, Abort)
    too_long = len(op.request_id.encode()) > MAX_REQUEST_ID_BYTES
    if outcome.code == Code.INVALID_ARGUMENT and too_long:
        return []
    if outcome.code != Code.OK:
        return [f"unexpected status {outcome.code.name}: {outcome.details!r}"]
    if outcome.aborted and not live_twins(outcome, outcomes):
        return ["aborted=True, but no call with its id could have been live"]
    return []


def check_stats(outcome: Outcome) -> list[str]:
    assert isinstance(outcome.operation, Stats)
    if outcome.code != Code.OK or outcome.stats is None:
        return [f"unexpected status {outcome.code.name}: {outcome.details!r}"]
    return stats_problems(outcome.stats)


def stats_problems(stats: scheduler_pb2.GetStatsResponse) -> list[str]:
    """What GetStats must say at any moment: sound pools, healthy executors."""
    problems = []
    if not stats.integrity.ok:
        problems.append(f"integrity check failed: {stats.integrity.message}")
    if stats.num_internal_errors:
        problems.append(f"num_internal_errors {stats.num_internal_errors} (see the log)")
    for executor in stats.executors:
        if not executor.healthy or executor.down_reason:
            problems.append(f"executor {executor.address} down: {executor.down_reason!r}")
    return problems


def check_greedy_agreement(outcomes: list[Outcome]) -> list[str]:
    """Greedy sequences of one prompt are one continuation, cut at different
    points: batching, preemption and prefix caching do not change them."""
    by_prompt: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for index, outcome in enumerate(outcomes):
        op = outcome.operation
        if not isinstance(op, Generate) or op.temperature or op.beam_width:
            continue
        tokens: dict[int, list[int]] = {}
        for chunk in outcome.chunks:
            for output in chunk.outputs:
                tokens.setdefault(output.index, []).extend(output.token_ids)
        for sequence in tokens.values():
            by_prompt.setdefault(tuple(op.prompt), []).append((index, sequence))
    problems = []
    for runs in by_prompt.values():
        first_index, longest = max(runs, key=lambda run: len(run[1]))
        for index, sequence in runs:
            if sequence != longest[: len(sequence)]:
                problems.append(
                    f"greedy outputs of one prompt differ: operation {index} {sequence} "
                    f"vs operation {first_index} {longest}"
                )
    return problems
