"""Continuous batching for one executor: its block accounting, rows, waiting
and running sequences, and the step messages between them.

``schedule()`` builds one ``StepRequest``: running sequences first (a decode
token each, or the next chunk of their prompt), preempting by recompute when
one cannot get a block (the least important, newest running sequence first;
its full blocks stay in the prefix cache), then admission from the waiting
queue in (priority, arrival) order with a prefix-cache lookup, all within a
token budget. ``process()`` applies the executor's samples, checks stop
conditions and releases finished sequences (their rows are freed in the next
step). No I/O here: ``SchedulerService`` moves the messages.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.scheduler.cache_events import CacheEvent, tag_changes
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.kv_cache_types import Allocation, BlockCopy
from pagedkv.scheduler.sequence import FinishReason, Generation, Sequence, SequenceState
from pagedkv.v1 import common_pb2, executor_pb2, scheduler_pb2


def specs_from_info(info: executor_pb2.GetInfoResponse) -> list[KVCacheSpec]:
    """The executor's KV cache groups as block-core specs, in wire order."""
    return [
        KVCacheSpec(
            block_size=group.block_size,
            num_layers=len(group.layer_indices),
            num_kv_heads=group.num_kv_heads,
            head_size=group.head_size,
            dtype=group.dtype,
            sliding_window=group.sliding_window if group.HasField("sliding_window") else None,
        )
        for group in info.kv_cache_groups
    ]


@dataclass(frozen=True, slots=True)
class Entry:
    """One sequence scheduled in a step, with its table changes (None: send
    the whole table, the executor does not know the sequence yet)."""

    seq: Sequence
    num_scheduled: int
    needs_sample: bool
    allocation: Allocation | None
    epoch: int  # the sequence's epoch when scheduled (a release bumps it)


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """A step's message and entries. ``before``: copy-only messages to send
    first, in order (see ``copy_phases``); usually none."""

    request: executor_pb2.StepRequest
    entries: list[Entry]
    before: tuple[executor_pb2.StepRequest, ...] = ()


def copy_phases(copies: list[BlockCopy]) -> list[list[BlockCopy]]:
    """Splits a step's copy-on-write copies, in the order they were made,
    into phases the executor can apply each at once (its destinations
    distinct, none of them a source), so that applying the phases in turn is
    the same as applying the copies one by one. A block freed and handed out
    again in the same step (a preemption between two allocations) can be a
    source and then a destination, or a destination twice."""
    phases: list[list[BlockCopy]] = [[]]
    sources: set[int] = set()
    destinations: set[int] = set()
    for copy in copies:
        if copy.src in destinations or copy.dst in sources or copy.dst in destinations:
            phases.append([])
            sources, destinations = set(), set()
        phases[-1].append(copy)
        sources.add(copy.src)
        destinations.add(copy.dst)
    return phases


class Processed(NamedTuple):
    """What applying a step's samples did: the generations with news, and
    the generations whose handling raised (the scheduler's own bugs; the
    caller fails them, the others went on)."""

    touched: set[Generation]
    errors: list[tuple[Generation, Exception]]


def _order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.generation.priority, seq.generation.arrival, seq.index)


class ExecutorScheduler:
    """The scheduling state of one executor (see the module docstring)."""

    def __init__(
        self,
        address: str,
        info: executor_pb2.GetInfoResponse,
        owner: common_pb2.Owner,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cached: Iterable[CacheEvent] = (),
    ) -> None:
        """``cached``: the executor's tagged blocks (ListCachedBlocks, oldest
        first) when it was taken over with its cache; they start in the
        prefix-cache index (blocks that cannot be adopted are untagged in
        the first step)."""
        self.address = address
        self.info = info
        self.owner = owner
        self.kv = KVCacheManager(
            specs_from_info(info), info.num_blocks, model_id=info.model_id, record_events=True
        )
        self.num_adopted_cached_blocks = self.kv.pool.adopt_cached_blocks(cached)
        self.draining = False  # being given up: nothing new is admitted here
        self.released = False  # given up: the step loop ends once no step is in flight
        self.stopped = asyncio.Event()  # set when the step loop has ended
        # Receives every batch of cache events as it goes out to the executor
        # (the Redis prefix mirror); must not block.
        self.on_cache_events: Callable[[list[CacheEvent]], None] | None = None
        self.num_groups = len(info.kv_cache_groups)
        self.max_num_seqs = min(max_num_seqs, info.max_num_rows)
        self.token_budget = min(max_num_batched_tokens, info.max_num_batched_tokens)
        self.free_rows = list(range(info.max_num_rows - 1, -1, -1))  # pop() gives row 0 first
        self.waiting: list[Sequence] = []  # sorted by _order
        self.running: list[Sequence] = []
        self.freed_rows: list[int] = []  # rows to free in the next step
        self.step_id = 0
        self.num_preemptions = 0
        # The sequence being scheduled, encoded or applied: when the
        # scheduler's own code raises, the request it concerns.
        self.current: Sequence | None = None

    # -- membership -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a sequence (new, or moved here to be recomputed)."""
        seq.executor = self.address
        seq.state = SequenceState.WAITING
        bisect.insort_right(self.waiting, seq, key=_order)

    @property
    def sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def release(self, seq: Sequence) -> None:
        """Forgets a sequence here: its blocks go back to the pool (full ones
        stay cached) and its row is freed in the next step. Rows reserved for
        its generation's forks return once every sequence has finished."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        request = seq.request
        # A decode still in flight counts a token not known here yet.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        self.kv.free(request)
        generation = seq.generation
        if seq.row is not None:
            if seq.table_lengths is not None:
                self.freed_rows.append(seq.row)
            if generation.beam is not None and not generation.done:
                generation.reserved_rows.append(seq.row)  # a beam search keeps its W rows
            else:
                self.free_rows.append(seq.row)
            seq.row = None
        seq.table_lengths = None
        seq.token_unsent = False
        seq.pending_on_executor = False
        seq.inflight_samples = 0
        seq.epoch += 1  # responses to steps already sent no longer apply
        if generation.reserved_rows and all(s.finished for s in generation.sequences):
            self.free_rows.extend(generation.reserved_rows)
            generation.reserved_rows.clear()

    def _take_row(self, generation: Generation) -> int:
        """A row for a fork: from the generation's reserve, else a free one."""
        if generation.reserved_rows:
            return generation.reserved_rows.pop()
        return self.free_rows.pop()

    def evacuate(self) -> list[Sequence]:
        """Every unfinished sequence, made ready to be recomputed elsewhere
        (this executor is gone: its state is dropped, not freed)."""
        moved = [s for s in self.sequences if not s.finished]
        for seq in moved:
            seq.generation.reserved_rows.clear()  # rows of this executor
            seq.row = None
            seq.table_lengths = None
            seq.token_unsent = False
            seq.pending_on_executor = False
            seq.inflight_samples = 0
            seq.epoch += 1
            seq.executor = None
            seq.request.num_computed_tokens = 0
            seq.state = SequenceState.WAITING
        self.running, self.waiting = [], []
        return moved

    # -- scheduling -----------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.request.num_computed_tokens = 0
        seq.request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _victim(self, protected: set[Sequence]) -> Sequence | None:
        candidates = [s for s in self.running if s not in protected]
        return max(candidates, key=_order) if candidates else None

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when there is nothing to send."""
        budget = self.token_budget
        entries: list[Entry] = []
        scheduled: set[Sequence] = set()
        preempted = False
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted for an earlier one
                continue
            self.current = seq
            request = seq.request
            # A sample still in flight (async stepping): its token is not
            # known here yet; the executor continues from it, and the slot
            # is allocated ahead.
            ahead = 1 if seq.inflight_samples else 0
            if ahead and seq.generation.beam is not None:
                continue  # a beam's next token is chosen here, after its round
            num_new = min(request.num_tokens - request.num_computed_tokens, budget - ahead)
            if num_new + ahead == 0:
                continue  # a beam waiting for its round: nothing to compute yet
            while True:
                allocation = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=ahead)
                if allocation is not None:
                    break
                victim = self._victim(scheduled | {seq})
                if victim is None:
                    victim = seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.state is not SequenceState.RUNNING:
                continue
            entries.append(self._entry(seq, num_new + ahead, allocation))
            scheduled.add(seq)
            budget -= num_new + ahead
        while not preempted and not self.draining and self.waiting and budget > 0:
            seq = self.waiting[0]
            self.current = seq
            generation = seq.generation
            rows_needed = 1
            if not seq.admitted and generation.beam is not None:
                rows_needed = generation.beam.width
            elif not generation.forked and seq.index == 0:
                rows_needed = generation.n
            if len(self.running) + rows_needed > self.max_num_seqs:
                break
            if len(self.free_rows) + len(generation.reserved_rows) < rows_needed:
                break
            request = seq.request
            computed = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            if self.kv.allocate_slots(request, num_new, computed) is None:
                break
            self.waiting.pop(0)
            if not seq.admitted:
                seq.admitted = True
                if seq.index == 0:
                    generation.num_cached_prompt_tokens = request.num_computed_tokens
            seq.state = SequenceState.RUNNING
            seq.row = self._take_row(generation)
            for _ in range(rows_needed - 1):  # for the forks to come
                generation.reserved_rows.append(self.free_rows.pop())
            self.running.append(seq)
            entries.append(self._entry(seq, num_new, None))
            scheduled.add(seq)
            budget -= num_new
        self.current = None
        if not entries and not self.freed_rows:
            return None
        step = self._message(entries)
        self.current = None
        return step

    def _entry(self, seq: Sequence, num_new: int, allocation: Allocation | None) -> Entry:
        """An entry of ``num_new`` tokens; the request's computed count moves
        on now (the executor computes them before any later step)."""
        request = seq.request
        num_known = request.num_tokens + seq.inflight_samples
        needs_sample = request.num_computed_tokens + num_new == num_known
        return Entry(
            seq,
            num_new,
            needs_sample,
            allocation if seq.table_lengths is not None else None,
            seq.epoch,
        )

    def _message(self, entries: list[Entry]) -> ScheduledStep:
        """The StepRequest of ``entries`` (new sequences first, as the wire wants)."""
        new = [e for e in entries if e.seq.table_lengths is None]
        old = [e for e in entries if e.seq.table_lengths is not None]
        ordered = new + old
        *early, copies = copy_phases(self.kv.take_copy_ops())
        before: list[executor_pb2.StepRequest] = []
        for phase in early:  # rare: see copy_phases
            before.append(self._copy_message(phase))
        message = self._copy_message(copies)
        events = self.kv.pool.take_events()
        if events:
            untag, tags = tag_changes(events)
            # Untags go in the first message that may write into a block.
            (before[0] if before else message).untag_block_ids.extend(untag)
            message.tag_block_ids.extend([t.block_id for t in tags])
            message.tag_block_hashes.extend([t.block_hash for t in tags])
            message.tag_group_ids.extend([t.group_id for t in tags])
            if self.on_cache_events is not None:
                self.on_cache_events(events)
        message.freed_rows.extend(self.freed_rows)
        self.freed_rows = []
        for entry in new:
            seq = entry.seq
            self.current = seq
            assert seq.row is not None
            message.new_requests.add(
                request_id=seq.seq_id,
                row=seq.row,
                prompt_token_ids=seq.request.token_ids,
                sampling=seq.generation.sampling_for(seq.index),
            )
        message.rows.extend([entry.seq.row for entry in old])  # type: ignore[misc]
        scheduled, computed, cont, needs, tokens = [], [], [], [], []
        starts: list[int] = []
        counts: list[int] = []
        block_ids: list[int] = []
        for entry in ordered:
            seq = entry.seq
            self.current = seq
            request = seq.request
            scheduled.append(entry.num_scheduled)
            computed.append(request.num_computed_tokens)
            request.num_computed_tokens += entry.num_scheduled
            cont.append(seq.pending_on_executor)
            needs.append(entry.needs_sample)
            # The executor keeps what it samples now and appends it when a
            # later step continues from it (beams send their chosen token).
            seq.pending_on_executor = entry.needs_sample and seq.generation.beam is None
            seq.inflight_samples += entry.needs_sample
            lengths = seq.table_lengths
            if seq.token_unsent:  # a beam's token, chosen here, not sampled there
                if lengths is not None:
                    tokens.append(request.token_ids[-1])
                seq.token_unsent = False
            if lengths is None or entry.allocation is None:
                tables = self.kv.get_block_ids(request.request_id)
                seq.table_lengths = [len(table) for table in tables]
                for table in tables:
                    starts.append(0)
                    counts.append(len(table))
                    block_ids.extend(table)
            elif not entry.allocation.updates:
                starts.extend(lengths)
                counts.extend([0] * len(lengths))
            else:
                for g, update in enumerate(entry.allocation.updates):
                    lengths[g] = update.start + len(update.block_ids)
                    starts.append(update.start)
                    counts.append(len(update.block_ids))
                    block_ids.extend(update.block_ids)
        message.num_scheduled_tokens.extend(scheduled)
        message.num_computed_tokens.extend(computed)
        message.continue_from_sampled.extend(cont)
        message.needs_sample.extend(needs)
        message.token_ids.extend(tokens)
        message.block_table_starts.extend(starts)
        message.new_block_counts.extend(counts)
        message.new_block_ids.extend(block_ids)
        return ScheduledStep(message, ordered, tuple(before))

    def _copy_message(self, copies: list[BlockCopy]) -> executor_pb2.StepRequest:
        """A StepRequest with the next step id and ``copies`` (nothing else)."""
        message = executor_pb2.StepRequest(
            owner=self.owner,
            step_id=self.step_id,
            copy_src_block_ids=[c.src for c in copies],
            copy_dst_block_ids=[c.dst for c in copies],
        )
        self.step_id += 1
        return message

    # -- results --------------------------------------------------------------

    def process(self, step: ScheduledStep, response: executor_pb2.StepResponse) -> Processed:
        """Applies a step's samples. A generation whose handling raises is
        left as it is and reported in ``errors``; the others go on."""
        touched: set[Generation] = set()
        beams: set[Generation] = set()
        errors: list[tuple[Generation, Exception]] = []
        samples = iter(range(len(response.sampled_token_ids)))
        top_offset = 0
        for entry in step.entries:
            if not entry.needs_sample:
                continue
            i = next(samples)
            top = slice(top_offset, top_offset + response.num_top_logprobs[i])
            top_offset = top.stop
            seq = entry.seq
            if entry.epoch != seq.epoch or seq.state is not SequenceState.RUNNING:
                continue  # aborted, preempted or moved while the step ran
            self.current = seq
            try:
                if self._apply(seq, response, i, top):
                    beams.add(seq.generation)
                else:
                    touched.add(seq.generation)
            except Exception as exc:
                errors.append((seq.generation, exc))
        for generation in beams - {generation for generation, _ in errors}:
            self.current = generation.sequences[0] if generation.sequences else None
            try:
                if self._beam_round(generation):
                    touched.add(generation)
            except Exception as exc:
                errors.append((generation, exc))
        self.current = None
        failed = {generation for generation, _ in errors}
        return Processed(touched - failed, errors)

    def _apply(
        self, seq: Sequence, response: executor_pb2.StepResponse, i: int, top: slice
    ) -> bool:
        """Applies sample ``i`` to ``seq``; returns whether it is a beam's
        candidates (chosen from in the beam round)."""
        seq.inflight_samples -= 1
        if seq.generation.beam is not None:
            seq.candidates = list(
                zip(response.top_logprobs[top], response.top_token_ids[top], strict=True)
            )
            return True
        if seq.generation.sampling.HasField("logprobs"):
            seq.pending_logprobs.append(
                scheduler_pb2.TokenLogprobs(
                    logprob=response.sampled_logprobs[i],
                    top_token_ids=response.top_token_ids[top],
                    top_logprobs=response.top_logprobs[top],
                )
            )
        self._append(seq, response.sampled_token_ids[i])
        return False

    def _beam_round(self, generation: Generation) -> bool:
        """Once every live beam has its candidates: prunes, forks and extends
        the beams (see beam.py). Returns whether the generation finished."""
        search = generation.beam
        assert search is not None
        live = [s for s in generation.sequences if not s.finished]
        if any(s.candidates is None for s in live):
            return False  # a beam was preempted: the round waits for it
        prompt_len = generation.num_prompt_tokens

        def finish_reason(token: int) -> int | None:
            if token in generation.stop_token_ids:
                return int(FinishReason.FINISH_REASON_STOP)
            if token in generation.eos_token_ids:
                return int(FinishReason.FINISH_REASON_EOS)
            return None

        survivors = search.select(
            live,
            lambda s: s.cum_logprob,
            lambda s: s.candidates or [],
            finish_reason,
            lambda s: s.request.token_ids[prompt_len:],
        )
        chosen: dict[Sequence, list[tuple[int, float]]] = {}
        for candidate in survivors:
            chosen.setdefault(candidate.beam, []).append((candidate.token, candidate.score))
        for seq in live:  # pruned beams give their blocks and rows back first
            seq.candidates = None
            if seq not in chosen:
                seq.finish(FinishReason.FINISH_REASON_UNSPECIFIED)
                self.release(seq)
                generation.sequences.remove(seq)
        for seq, picks in chosen.items():
            for token, score in picks[1:]:
                self._extend_beam(self._fork_beam(seq), token, score)
            self._extend_beam(seq, *picks[0])
        if search.done or all(s.finished for s in generation.sequences):
            for seq in generation.sequences:
                if not seq.finished:
                    seq.finish(FinishReason.FINISH_REASON_LENGTH)
                    self.release(seq)
            return True
        return False

    def _fork_beam(self, parent: Sequence) -> Sequence:
        generation = parent.generation
        assert generation.beam is not None
        generation.beam.num_forks += 1
        request = self.kv.make_request(
            generation.new_seq_id(),
            parent.request.token_ids,
            cache_salt=generation.cache_salt or None,
            priority=generation.priority,
        )
        request.num_prompt_tokens = generation.num_prompt_tokens
        self.kv.fork(parent.request, request)
        child = Sequence(generation, len(generation.sequences), request)
        child.admitted = True
        child.executor = self.address
        child.state = SequenceState.RUNNING
        child.row = self._take_row(generation)
        child.cum_logprob = parent.cum_logprob
        generation.sequences.append(child)
        self.running.append(child)
        return child

    def _extend_beam(self, seq: Sequence, token: int, score: float) -> None:
        """Appends the beam's chosen token; a beam at its length limit finishes."""
        generation = seq.generation
        assert generation.beam is not None
        request = seq.request
        request.append_output_token_ids(token)
        seq.cum_logprob = score
        seq.token_unsent = True
        if (
            request.num_output_tokens >= generation.max_tokens
            or request.num_tokens >= self.info.max_model_len
        ):
            generation.beam.add_finished(
                score,
                request.token_ids[generation.num_prompt_tokens :],
                FinishReason.FINISH_REASON_LENGTH,
            )
            seq.finish(FinishReason.FINISH_REASON_LENGTH)
            self.release(seq)

    def _append(self, seq: Sequence, token: int) -> None:
        generation = seq.generation
        request = seq.request
        request.append_output_token_ids(token)
        seq.pending_token_ids.append(token)
        if seq.detokenizer is not None:
            seq.pending_text += seq.detokenizer.push([token])
        if token in generation.stop_token_ids:
            seq.finish(FinishReason.FINISH_REASON_STOP, token)
        elif token in generation.eos_token_ids:
            seq.finish(FinishReason.FINISH_REASON_EOS)
        elif (
            request.num_output_tokens >= generation.max_tokens
            or request.num_tokens >= self.info.max_model_len
        ):
            seq.finish(FinishReason.FINISH_REASON_LENGTH)
        if generation.n > 1 and not generation.forked and seq.index == 0:
            self._fork(seq)  # before a release: the others share its prompt blocks
        if seq.finished:
            self.release(seq)

    def _fork(self, parent: Sequence) -> None:
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
            self.kv.fork(parent_request, child)
            child.num_computed_tokens = len(prompt) - 1
            seq.admitted = True
            seq.executor = self.address
            seq.state = SequenceState.RUNNING
            seq.row = self._take_row(generation)
            self.running.append(seq)
        parent_request.num_computed_tokens = computed
