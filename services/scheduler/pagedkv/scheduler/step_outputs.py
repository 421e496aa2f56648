"""Applying a step's samples: the output processor of ``ExecutorScheduler``.

A step's response holds one sample per entry that asked for one, in entry
order (``ScheduledStep.sampled``). Each sample of a live sequence is appended
to its request and to its pending output, then checked once
(``Sequence.stop_reason``, and with stop strings ``Sequence.push_text``); a
finished sequence is released at once. Beams keep their candidates until
every live beam of the generation has them (see groups.py). Text is not made
here, except for sequences with stop strings (their text is matched as it
grows, see stop_strings.py): a message's text deltas are decoded when its
stream makes it (chunks.py).

The common sample (no beam search, no logprobs, no stop strings, no forks to
make) takes a short path through plain lists; the others go through
``_apply_sample``. A decode window's samples (one round per step, each round
in entry order) are applied per sequence instead: a plain sequence's tokens
of every round go in at once, cut at the first that stops it
(``Sequence.stop_index``, the same check token by token); the others'
samples one by one, round after round, so that the samples after the one
that stops a sequence (a stop string too) are dropped.

It changes the scheduler's rows and running list only through its methods
(``groups.Rows``); a generation whose handling raised is returned with its
error (``Processed.errors``), for the service to fail.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

from pagedkv.scheduler.groups import Rows, beam_round, fork_samples
from pagedkv.scheduler.sequence import ExecutorRow, Generation, Sequence, SequenceState
from pagedkv.scheduler.step_message import ScheduledStep
from pagedkv.v1 import executor_pb2, scheduler_pb2


class Processed(NamedTuple):
    """What applying a step's samples did: the generations with news, and
    the generations whose handling raised (the scheduler's own bugs; the
    caller fails them, the others went on)."""

    touched: set[Generation]
    errors: list[tuple[Generation, Exception]]


def apply_outputs(
    rows: Rows, step: ScheduledStep, response: executor_pb2.StepResponse
) -> Processed:
    """Applies a step's samples. A generation whose handling raises is
    left as it is and reported in ``errors``; the others go on. Raises
    ValueError, applying nothing, when the response has fewer samples than
    the step asked for."""
    sampled = step.sampled
    tokens = list(response.sampled_token_ids)  # one conversion for the whole step
    if len(tokens) < len(sampled) or len(response.num_top_logprobs) < len(sampled):
        raise ValueError(
            f"step {response.step_id}: the response has {len(tokens)} samples, "
            f"the step asked for {len(sampled)}"
        )
    num_steps = step.request.num_decode_steps
    if num_steps > 1:
        return _apply_window(rows, sampled, tokens, response, num_steps)
    touched: set[Generation] = set()
    beams: set[Generation] = set()
    errors: list[tuple[Generation, Exception]] = []
    add = touched.add
    running = SequenceState.RUNNING
    top_starts: list[int] | None = None  # where each sample's top logprobs start
    for k, (seq, placed) in enumerate(sampled):
        if seq.placed is not placed or seq.state is not running:
            continue  # aborted, preempted or moved while the step ran
        generation = seq.generation
        try:
            placed.inflight_samples -= 1
            if generation.plain:
                token = tokens[k]
                seq.request.token_ids.append(token)
                seq.pending_token_ids.append(token)
                reason = seq.stop_reason(token)
                if reason is not None:
                    seq.finish(reason, token if reason == _STOP else None)
                    rows.release(seq)
                add(generation)
                continue
            if top_starts is None:
                top_starts = list(accumulate(response.num_top_logprobs, initial=0))
            if _apply_sample(rows, seq, response, k, slice(top_starts[k], top_starts[k + 1])):
                add(generation)
            else:
                beams.add(generation)
        except Exception as exc:
            errors.append((generation, exc))
    for generation in beams - {generation for generation, _ in errors}:
        try:
            if beam_round(rows, generation):
                add(generation)
        except Exception as exc:
            errors.append((generation, exc))
    failed = {generation for generation, _ in errors}
    return Processed(touched - failed if failed else touched, errors)


def _apply_window(
    rows: Rows,
    sampled: list[tuple[Sequence, ExecutorRow]],
    tokens: list[int],
    response: executor_pb2.StepResponse,
    num_steps: int,
) -> Processed:
    """A decode window's samples, sequence by sequence (no beams: windows
    have none)."""
    width = len(sampled) // num_steps
    touched: set[Generation] = set()
    errors: list[tuple[Generation, Exception]] = []
    running = SequenceState.RUNNING
    top_starts: list[int] | None = None
    for e in range(width):
        seq, placed = sampled[e]
        if seq.placed is not placed or seq.state is not running:
            continue  # aborted, preempted or moved while the window ran
        generation = seq.generation
        try:
            if generation.plain:
                window = tokens[e : len(sampled) : width]
                end, reason = seq.stop_index(window)
                applied = window[: end + 1] if end < len(window) else window
                placed.inflight_samples -= len(applied)
                seq.request.token_ids.extend(applied)
                seq.pending_token_ids.extend(applied)
                generation.window_tokens = len(applied)
                if reason is not None:
                    seq.finish(reason, applied[-1] if reason == _STOP else None)
                    rows.release(seq)
                touched.add(generation)
                continue
            if top_starts is None:
                top_starts = list(accumulate(response.num_top_logprobs, initial=0))
            for k in range(e, len(sampled), width):
                if seq.placed is not placed or seq.state is not running:
                    break  # it stopped inside the window
                placed.inflight_samples -= 1
                top = slice(top_starts[k], top_starts[k + 1])
                if _apply_sample(rows, seq, response, k, top):
                    touched.add(generation)
        except Exception as exc:
            errors.append((generation, exc))
    failed = {generation for generation, _ in errors}
    return Processed(touched - failed if failed else touched, errors)


def _apply_sample(
    rows: Rows,
    seq: Sequence,
    response: executor_pb2.StepResponse,
    k: int,
    top: slice,
) -> bool:
    """Sample ``k`` of the response (its top logprobs at ``top``) off the
    short path: a beam's candidates (False: its round comes once every live
    beam has them), logprobs, the forks of parallel sampling. True when the
    generation has news."""
    generation = seq.generation
    if generation.beam is not None:
        seq.candidates = list(
            zip(response.top_logprobs[top], response.top_token_ids[top], strict=True)
        )
        return False
    if generation.sampling.HasField("logprobs"):
        seq.pending_logprobs.append(
            scheduler_pb2.TokenLogprobs(
                logprob=response.sampled_logprobs[k],
                top_token_ids=response.top_token_ids[top],
                top_logprobs=response.top_logprobs[top],
            )
        )
    token = response.sampled_token_ids[k]
    seq.request.append_output_token_ids(token)
    seq.pending_token_ids.append(token)
    reason = seq.stop_reason(token)
    stop_string = seq.push_text(token)
    if stop_string is not None:
        reason = _STOP
        seq.finish(reason)
    elif reason is not None:
        seq.finish(reason, token if reason == _STOP else None)
    if generation.n > 1 and not generation.forked and seq.index == 0:
        fork_samples(rows, seq)  # before a release: they share its prompt blocks
    if reason is not None:
        rows.release(seq)
    return True


_STOP = scheduler_pb2.FinishReason.FINISH_REASON_STOP
