"""Continuous batching for one executor: its block accounting, rows, waiting
and running sequences, and its steps.

A step, in order: ``schedule()`` decides it (the policy: running sequences
first, in (priority, arrival) order, a decode token each or the next chunk
of their prompt, preempting by recompute when one cannot get a block, the
least important, newest running sequence first, its full blocks staying in
the prefix cache; then admission from the waiting queue in (priority,
arrival) order with a prefix-cache lookup, all within a token budget),
makes the step's state changes and records them in a ``StepPlan`` (the
entries' by entry_writer.py), which ``encode_step`` turns into messages
(step_message.py, no state changes there). ``process()`` applies the
executor's samples (step_outputs.py); forks and beams are in groups.py.

Decode entries of consecutive running sequences get their slots in one
``KVCacheManager.allocate_decode_slots`` call, the block core's decode path.
No I/O here: ``SchedulerService`` moves the messages.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Iterable
from itertools import repeat

from pagedkv.common.kv_cache_spec import specs_from_info
from pagedkv.common.step_contract import ONE_STEP
from pagedkv.scheduler.cache_events import CacheEvent
from pagedkv.scheduler.entry_writer import EntryWriter
from pagedkv.scheduler.groups import stalled_beams
from pagedkv.scheduler.host_tier import LoadCosts
from pagedkv.scheduler.kv_cache_manager import NO_TABLE_CHANGE, KVCacheManager
from pagedkv.scheduler.kv_cache_types import Allocation
from pagedkv.scheduler.sequence import ExecutorRow, Generation, Sequence, SequenceState
from pagedkv.scheduler.step_message import ScheduledStep, StepPlan, copy_phases, encode_step
from pagedkv.scheduler.step_outputs import Processed, apply_outputs
from pagedkv.scheduler.windows import Decision, Window, window_steps
from pagedkv.v1 import common_pb2, executor_pb2

__all__ = ["ExecutorScheduler", "Processed", "ScheduledStep", "copy_phases"]


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
        host_cached: Iterable[CacheEvent] = (),
        decode_window: int = ONE_STEP,
        host_loads: str = "auto",
        host_offload: str = "eviction",
        host_idle_offload_blocks: int = 0,
    ) -> None:
        """``cached``: the executor's tagged blocks (ListCachedBlocks, oldest
        first) when it was taken over with its cache; they start in the
        prefix-cache index (blocks that cannot be adopted are untagged in
        the first step). ``host_cached``: its host tier's, likewise, for the
        host index. ``host_idle_offload_blocks``: see ``idle_step`` (0: no
        idle steps)."""
        self.address = address
        self.decode_window = decode_window  # most decode steps in one message (windows.py)
        self.info = info
        self.owner = owner
        self.kv = KVCacheManager(
            specs_from_info(info),
            info.num_blocks,
            model_id=info.model_id,
            record_events=True,
            num_host_blocks=info.num_host_blocks,
            host_costs=LoadCosts(
                info.prefill_seconds_per_token,
                info.host_load_seconds,
                info.host_load_seconds_per_block,
            ),
            host_loads=host_loads,
            host_write_through=host_offload == "write-through",
        )
        self.num_adopted_cached_blocks = self.kv.pool.adopt_cached_blocks(cached)
        if self.kv.host is not None:
            self.kv.host.adopt(host_cached)
        self.host_idle_offload_blocks = host_idle_offload_blocks
        self.draining = False  # being given up: nothing new is admitted here
        self.released = False  # given up: the step loop ends once no step is in flight
        self.stopped = asyncio.Event()  # set when the step loop has ended
        # Receives every batch of cache events as it goes out to the executor
        # (the Redis prefix mirror); must not block.
        self.on_cache_events: Callable[[list[CacheEvent]], None] | None = None
        self.on_host_cache_events: Callable[[list[CacheEvent]], None] | None = None
        self.num_groups = len(info.kv_cache_groups)
        self._entries = EntryWriter(self.kv, self.num_groups)
        self.max_model_len = info.max_model_len
        # The blocks' dtype, as GetStats and the metrics name it (all groups share it).
        self.kv_cache_dtype = info.kv_cache_groups[0].dtype if info.kv_cache_groups else ""
        # The most tokens one sequence's blocks can hold with the whole pool
        # to itself: a sequence ends there (FINISH_REASON_LENGTH, as at
        # max_model_len) instead of outgrowing the pool, after which it could
        # never be admitted again. (Sliding windows free blocks as they go:
        # no such bound there.)
        self.max_seq_tokens = info.max_model_len
        if not any(group.HasField("sliding_window") for group in info.kv_cache_groups):
            usable = info.num_blocks - 1  # block 0 is the null block
            self.max_seq_tokens = usable // self.num_groups * info.block_size
        self.max_num_seqs = min(max_num_seqs, info.max_num_rows)
        self.token_budget = min(max_num_batched_tokens, info.max_num_batched_tokens)
        self.free_rows = list(range(info.max_num_rows - 1, -1, -1))  # pop() gives row 0 first
        self.waiting: list[Sequence] = []  # sorted by _order
        # Sorted by _order too: the most important is scheduled first, so a
        # sequence that misses a block only ever preempts less important ones.
        self.running: list[Sequence] = []
        self.freed_rows: list[int] = []  # rows to free in the next step
        self.step_id = 0  # the next step's id
        self.num_preemptions = 0
        # The sequence being scheduled, encoded or applied: when the
        # scheduler's own code raises, the request it concerns.
        self.current: Sequence | None = None

    # -- membership -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a sequence (new, or moved here to be recomputed)."""
        self._join(seq)
        seq.state = SequenceState.WAITING
        bisect.insort_right(self.waiting, seq, key=_order)

    def _join(self, seq: Sequence) -> None:
        seq.executor = self.address
        request = seq.request
        seq.max_num_tokens = min(
            request.num_prompt_tokens + seq.generation.max_tokens,
            self.max_model_len,
            self.max_seq_tokens,
        )

    def start_running(self, seq: Sequence) -> None:
        """Runs a fork at once (its blocks shared with its parent's): a row
        from its generation's reserve, or a free one."""
        self._join(seq)
        seq.state = SequenceState.RUNNING
        seq.placed = ExecutorRow(self._take_row(seq.generation))
        bisect.insort_right(self.running, seq, key=_order)

    @property
    def sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def release(self, seq: Sequence) -> None:
        """Forgets a sequence here: its blocks go back to the pool (full ones
        stay cached) and its row is freed in the next step. Rows reserved for
        its generation's forks return once every sequence has finished."""
        if seq.state is SequenceState.RUNNING or seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        request = seq.request
        # A decode still in flight counts a token not known here yet.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        self.kv.free(request)
        generation = seq.generation
        placed = seq.detach()
        if placed is not None:
            if placed.table_lengths is not None:
                self.freed_rows.append(placed.row)
            if generation.beam is not None and not generation.done:
                generation.reserved_rows.append(placed.row)  # a beam search keeps its W rows
            else:
                self.free_rows.append(placed.row)
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
            seq.detach()
            seq.executor = None
            seq.request.num_computed_tokens = 0
            seq.state = SequenceState.WAITING
        self.running, self.waiting = [], []
        return moved

    # -- giving the executor up ---------------------------------------------

    def start_draining(self) -> None:
        """Nothing new is admitted here from now on (the executor is being
        given up, or the scheduler is stopping)."""
        self.draining = True

    def take_unstarted(self) -> list[Sequence]:
        """Takes the waiting sequences that never ran here (none of their
        state is on the executor, and no fork shares their blocks): they can
        move to another executor as they are."""
        unstarted = [s for s in self.waiting if s.row is None and not s.generation.forked]
        if unstarted:
            taken = set(unstarted)
            self.waiting[:] = [s for s in self.waiting if s not in taken]
        return unstarted

    def give_up(self) -> None:
        """Marks the executor given up: its step loop ends once no step is
        in flight (``stopped`` is set then)."""
        self.released = True

    def loop_ended(self) -> None:
        """The executor's step loop has ended: whoever waits on ``stopped``
        goes on."""
        self.stopped.set()

    def listen_cache_events(
        self,
        listener: Callable[[list[CacheEvent]], None],
        host_listener: Callable[[list[CacheEvent]], None] | None = None,
    ) -> None:
        """``listener`` receives every batch of cache events as it goes out
        to the executor (the Redis prefix mirror), ``host_listener`` those of
        the host tier's index; neither may block."""
        self.on_cache_events = listener
        self.on_host_cache_events = host_listener

    # -- scheduling -----------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.request.num_computed_tokens = 0
        seq.request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _victim(self, decisions: list[Decision], protected: Iterable[Sequence]) -> Sequence | None:
        """The running sequence to preempt: the least important, newest one
        neither decided on this step nor in ``protected``."""
        keep = {decision[0] for decision in decisions}
        keep.update(protected)
        candidates = [s for s in self.running if s not in keep]
        return max(candidates, key=_order) if candidates else None

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when there is nothing to send. Makes the
        step's state changes (see ``_plan``) before encoding it."""
        budget = self.token_budget
        decisions: list[Decision] = []
        decodes: list[Sequence] = []  # consecutive decodes, their slots not allocated yet
        preempted = False
        running = SequenceState.RUNNING
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.state is not running:  # preempted for an earlier one
                continue
            placed = seq.placed
            assert placed is not None
            request = seq.request
            # Samples still in flight (async stepping, windows): their tokens
            # are not known here yet; the executor continues from the last,
            # and its slot is allocated ahead.
            ahead = placed.inflight_samples
            if ahead and (
                seq.generation.beam is not None  # a beam's next token is chosen here
                or len(request.token_ids) + ahead >= seq.max_num_tokens  # it has them all
            ):
                continue
            num_new = len(request.token_ids) - request.num_computed_tokens
            if num_new > budget - ahead:
                num_new = budget - ahead
            if num_new + ahead == 1:
                decodes.append(seq)
                budget -= 1
                continue
            if num_new + ahead == 0 or ahead > 1:
                # A beam waiting for its round: nothing to compute yet. (A
                # sequence with several samples in flight only ever decodes.)
                continue
            if decodes:
                preempted |= self._allocate_decodes(decodes, decisions)
                decodes = []
                if seq.state is not running:
                    continue
            self.current = seq
            while True:
                allocation = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=ahead)
                if allocation is not None:
                    break
                victim = self._victim(decisions, (seq,)) or seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.state is not running:
                continue
            decisions.append((seq, num_new + ahead, allocation))
            budget -= num_new + ahead
        if decodes:
            # (A preemption here stops admission below, so the budget that
            # preempted decodes leave unused needs no refund.)
            preempted |= self._allocate_decodes(decodes, decisions)
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
            # Counted once admitted: a request that waits is looked up again
            # each step.
            computed = self.kv.get_computed_blocks(request, count=False)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            if self.kv.allocate_slots(request, num_new, computed) is None:
                break
            self.kv.count_lookup(request, computed)
            self.waiting.pop(0)
            if not seq.admitted:
                seq.admitted = True
                if seq.index == 0:
                    generation.num_cached_prompt_tokens = request.num_computed_tokens
            seq.state = SequenceState.RUNNING
            seq.placed = ExecutorRow(self._take_row(generation))
            for _ in range(rows_needed - 1):  # for the forks to come
                generation.reserved_rows.append(self.free_rows.pop())
            bisect.insort_right(self.running, seq, key=_order)
            decisions.append((seq, num_new, None))
            budget -= num_new
        self.current = None
        stalled = [] if decisions or preempted else stalled_beams(self.waiting, self.running)
        if stalled:
            for seq in stalled:
                self._preempt(seq)
            return self.schedule()  # the freed blocks admit what waited
        if not decisions and not self.freed_rows:
            return None
        window = Window(1, decisions)
        if not preempted:
            window = window_steps(self.decode_window, bool(self.waiting), self.kv, decisions)
        num_steps = window.num_steps
        plan, sampled = self._plan(window.decisions, num_steps)
        before, message = encode_step(self.owner, plan)
        return ScheduledStep(message, plan.num_scheduled_tokens, sampled * num_steps, before)

    def idle_step(self) -> ScheduledStep | None:
        """A step with no entries for an executor with nothing else to do (no
        request here, no step in flight: the step loop asks): it offloads to
        the host tier the cached blocks among the next
        ``host_idle_offload_blocks`` that the pool hands out, ahead of their
        eviction (``KVCacheManager.offload_ahead``). An admission that
        evicts them later then sends no offloads: their copies ran while the
        executor was idle, not in the step that waits for its first token.
        None when there is nothing to offload."""
        if self.running or self.waiting or self.draining or self.released:
            return None
        if not self.kv.offload_ahead(self.host_idle_offload_blocks):
            return None
        plan, _ = self._plan([])
        before, message = encode_step(self.owner, plan)
        return ScheduledStep(message, before=before)

    def _allocate_decodes(self, decodes: list[Sequence], decisions: list[Decision]) -> bool:
        """Gives each of ``decodes`` (running in this order, each with one
        token to compute or one in flight) a slot, in one block-core call;
        on a miss preempts as ``schedule`` does and goes on from there.
        Appends their decisions; returns whether anything was preempted."""
        requests = [seq.request for seq in decodes]
        allocations: list[Allocation] = [NO_TABLE_CHANGE] * len(decodes)
        preempted = False
        start = 0
        while start < len(decodes):
            result = self.kv.allocate_decode_slots(requests, start)
            for i, allocation in result.updates:
                allocations[i] = allocation
            end = start + result.num_allocated
            if end == len(decodes):
                break
            seq = decodes[end]  # it got no block
            self.current = seq
            victim = self._victim(decisions, decodes[: end + 1]) or seq
            self._preempt(victim)
            preempted = True
            if victim in decodes:  # never one before ``end``: they are protected
                index = decodes.index(victim)
                del decodes[index], requests[index], allocations[index]
            start = end
        decisions.extend(zip(decodes, repeat(1), allocations))
        self.current = None
        return preempted

    def _plan(
        self, decisions: list[Decision], num_steps: int = 1
    ) -> tuple[StepPlan, list[tuple[Sequence, ExecutorRow]]]:
        """Makes a step's state changes and returns what they send, and the
        samples it asks for (see ``ScheduledStep``): queued copies, cache
        events and freed rows are taken, step ids are used, and each entry's
        own changes are made as it is written (``EntryWriter``)."""
        events = self.kv.pool.take_events()
        if events and self.on_cache_events is not None:
            self.on_cache_events(events)
        plan = StepPlan.start(self.step_id, self.kv.take_copy_ops(), events, self.freed_rows)
        plan.offloads, plan.loads = self.kv.take_host_copies()
        if self.kv.host is not None:
            host_events = self.kv.host.take_events()
            if host_events and self.on_host_cache_events is not None:
                self.on_host_cache_events(host_events)
        plan.num_decode_steps = num_steps
        self.step_id += len(plan.copy_phases)
        self.freed_rows = []
        try:
            sampled = self._entries.write(plan, decisions, num_steps)
        except BaseException:
            self.current = self._entries.culprit  # the scheduler's own code raised
            raise
        return plan, sampled

    # -- results --------------------------------------------------------------

    def process(self, step: ScheduledStep, response: executor_pb2.StepResponse) -> Processed:
        """Applies a step's samples (see step_outputs.py)."""
        if self.kv.host is not None:
            us = (response.host_offload_time_us, response.host_load_time_us)
            self.kv.host.copy_seconds = (us[0] * 1e-6, us[1] * 1e-6)
        return apply_outputs(self, step, response)
