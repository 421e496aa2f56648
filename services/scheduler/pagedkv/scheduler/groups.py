"""Sequences that share blocks within one generation: the ``n - 1`` forks of
parallel sampling, and the beams of a beam search (see beam.py for which
beams survive a round).

Both work on one executor's scheduler through ``Rows``, the little they
need of it: its block core (forks share blocks through
``KVCacheManager.fork``) and the two methods that change its rows and
running list (``start_running``, ``release``), so that those keep one
writer, ``ExecutorScheduler`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.sequence import FinishReason, Generation, Sequence


class Rows(Protocol):
    """What forks and beams need of their executor's scheduler."""

    @property
    def kv(self) -> KVCacheManager: ...

    def start_running(self, seq: Sequence) -> None:
        """Runs a fork at once, on a row from its generation's reserve."""

    def release(self, seq: Sequence) -> None:
        """Forgets a sequence: its blocks and row go back."""


def fork_samples(rows: Rows, parent: Sequence) -> None:
    """The other n - 1 sequences share the parent's prompt blocks; each
    recomputes the last prompt token (copy-on-write of its block) to draw
    its own first token."""
    generation = parent.generation
    generation.forked = True
    prompt = generation.prompt_token_ids
    parent_request = parent.request
    computed = parent_request.num_computed_tokens  # may count a decode in flight
    parent_request.num_computed_tokens = len(prompt)
    for seq in generation.sequences[1:]:
        child = seq.request
        rows.kv.fork(parent_request, child)
        child.num_computed_tokens = len(prompt) - 1
        seq.admitted = True
        rows.start_running(seq)
    parent_request.num_computed_tokens = computed


def beam_round(rows: Rows, generation: Generation) -> bool:
    """Once every live beam has its candidates: prunes, forks and extends
    the beams. Returns whether the generation finished."""
    search = generation.beam
    assert search is not None
    live = [s for s in generation.sequences if not s.finished]
    if any(s.candidates is None for s in live):
        return False  # a beam was preempted: the round waits for it
    prompt_len = generation.num_prompt_tokens

    survivors = search.select(
        live,
        lambda s: s.cum_logprob,
        lambda s: s.candidates or [],
        generation.stop_token_reason,
        lambda s: s.request.token_ids[prompt_len:],
    )
    chosen: dict[Sequence, list[tuple[int, float]]] = {}
    for candidate in survivors:
        chosen.setdefault(candidate.beam, []).append((candidate.token, candidate.score))
    for seq in live:  # pruned beams give their blocks and rows back first
        seq.candidates = None
        if seq not in chosen:
            seq.finish(FinishReason.FINISH_REASON_UNSPECIFIED)
            rows.release(seq)
            generation.sequences.remove(seq)
    for seq, picks in chosen.items():
        for token, score in picks[1:]:
            _extend_beam(rows, _fork_beam(rows, seq), token, score)
        _extend_beam(rows, seq, *picks[0])
    if search.done or all(s.finished for s in generation.sequences):
        for seq in generation.sequences:
            if not seq.finished:
                seq.finish(FinishReason.FINISH_REASON_LENGTH)
                rows.release(seq)
        return True
    return False


def _fork_beam(rows: Rows, parent: Sequence) -> Sequence:
    generation = parent.generation
    assert generation.beam is not None
    generation.beam.num_forks += 1
    kv = rows.kv
    request = kv.make_request(
        generation.new_seq_id(),
        parent.request.token_ids,
        cache_salt=generation.cache_salt or None,
        priority=generation.priority,
    )
    request.num_prompt_tokens = generation.num_prompt_tokens
    kv.fork(parent.request, request)
    child = Sequence(generation, len(generation.sequences), request)
    child.admitted = True
    child.cum_logprob = parent.cum_logprob
    generation.sequences.append(child)
    rows.start_running(child)
    return child


def _extend_beam(rows: Rows, seq: Sequence, token: int, score: float) -> None:
    """Appends the beam's chosen token; a beam at its length limit finishes."""
    generation = seq.generation
    assert generation.beam is not None and seq.placed is not None
    request = seq.request
    request.append_output_token_ids(token)
    seq.cum_logprob = score
    seq.placed.token_unsent = True
    if request.num_tokens >= seq.max_num_tokens:
        generation.beam.add_finished(
            score,
            request.token_ids[generation.num_prompt_tokens :],
            FinishReason.FINISH_REASON_LENGTH,
        )
        seq.finish(FinishReason.FINISH_REASON_LENGTH)
        rows.release(seq)


def stalled_beams(waiting: Seq[Sequence], running: Seq[Sequence]) -> list[Sequence]:
    """The running beams to preempt so that steps can come again, or none.

    When every running sequence is a beam waiting for its round (its
    candidates in, nothing in flight) while others wait for blocks, no step
    would ever come: the rounds wait for preempted beams that the waiting
    beams' blocks keep out. Then the least important, newest of those beam
    searches is to be preempted whole, so that the older ones get their
    beams back (each of them fits the pool alone). Changes nothing."""
    if not waiting or not running:
        return []
    stalled: dict[Generation, list[Sequence]] = {}
    for seq in running:
        placed = seq.placed
        if (
            seq.generation.beam is None
            or seq.candidates is None
            or (placed is not None and placed.inflight_samples)
        ):
            return []  # it has a step to come
        stalled.setdefault(seq.generation, []).append(seq)
    victim = max(stalled, key=lambda g: (g.priority, g.arrival, g.key))
    return stalled[victim]
