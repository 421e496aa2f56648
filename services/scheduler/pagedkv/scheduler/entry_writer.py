"""A step's entries: what each decided sequence sends, and its state
changes.

``EntryWriter.write`` turns the decisions of ``ExecutorScheduler.schedule``
into the entry columns of the step's ``StepPlan`` (new sequences first, as
the wire wants) and makes each entry's state changes as it goes: the
request's computed count moves on (the executor computes the tokens before
any later step) and the sequence's ``ExecutorRow`` records what the
executor will hold (table lengths, samples in flight, a sample kept there).
It changes nothing of the scheduler's own (queues, rows, step ids): the
scheduler starts the plan with those and applies the rest itself.
"""

from __future__ import annotations

from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.kv_cache_types import Allocation
from pagedkv.scheduler.sequence import ExecutorRow, Sequence
from pagedkv.scheduler.step_message import NewRequestPlan, StepPlan
from pagedkv.scheduler.windows import Decision


class EntryWriter:
    """Writes the entries of one executor's steps (see the module docstring).

    ``culprit``: after ``write`` raised, the sequence whose entry it was
    writing (None: before any), for the scheduler to blame.
    """

    __slots__ = ("_kv", "_no_new_blocks", "culprit")

    def __init__(self, kv: KVCacheManager, num_groups: int) -> None:
        self._kv = kv
        self._no_new_blocks = (0,) * num_groups  # a decode's new_block_counts
        self.culprit: Sequence | None = None

    def write(
        self, plan: StepPlan, decisions: list[Decision], num_steps: int
    ) -> list[tuple[Sequence, ExecutorRow]]:
        """Appends the entries of ``decisions`` to ``plan`` (new sequences
        first), making their state changes; returns the samples the step
        asks for (see ``ScheduledStep.sampled``). With ``num_steps`` > 1 (a
        window) each entry computes that many tokens."""
        # New sequences first. (Decided sequences are running: each holds a row.)
        new = [d for d in decisions if d[0].placed.table_lengths is None]  # type: ignore[union-attr]
        if new:
            old = [d for d in decisions if d[0].placed.table_lengths is not None]  # type: ignore[union-attr]
            decisions = new + old
        sampled: list[tuple[Sequence, ExecutorRow]] = []
        commit = self._commit
        seq = None
        try:
            for seq, _, _ in new:
                plan.new_requests.append(
                    NewRequestPlan(
                        seq.seq_id,
                        seq.placed.row,  # type: ignore[union-attr]
                        seq.request.token_ids[:],
                        seq.generation.sampling_for(seq.index),
                        seq.generation.num_prompt_tokens,
                    )
                )
            for seq, num, allocation in decisions:
                if commit(seq, num, allocation, plan):
                    sampled.append((seq, seq.placed))  # type: ignore[arg-type]
            if num_steps > 1:  # a window: each entry computes num_steps tokens
                for seq, _, _ in decisions:
                    placed = seq.placed
                    assert placed is not None
                    seq.request.num_computed_tokens += num_steps - 1
                    placed.inflight_samples += num_steps - 1
        except BaseException:
            self.culprit = seq
            raise
        plan.num_scheduled_tokens = [num for _, num, _ in decisions]
        return sampled

    def _commit(
        self, seq: Sequence, num: int, allocation: Allocation | None, plan: StepPlan
    ) -> bool:
        """One entry's state changes (see the module docstring), appended to
        ``plan``; returns whether the entry asks for a sample."""
        placed = seq.placed
        assert placed is not None
        request = seq.request
        computed = request.num_computed_tokens
        request.num_computed_tokens = computed + num
        inflight = placed.inflight_samples
        needs_sample = computed + num == len(request.token_ids) + inflight
        plan.num_computed_tokens.append(computed)
        plan.continue_from_sampled.append(placed.pending_on_executor)
        plan.needs_sample.append(needs_sample)
        # The executor keeps what it samples now and appends it when a
        # later step continues from it (beams send their chosen token).
        if needs_sample:
            placed.pending_on_executor = seq.generation.beam is None
            placed.inflight_samples = inflight + 1
        else:
            placed.pending_on_executor = False
        lengths = placed.table_lengths
        if placed.token_unsent:  # a beam's token, chosen here, not sampled there
            if lengths is not None:
                plan.token_ids.append(request.token_ids[-1])
            placed.token_unsent = False
        if lengths is None or allocation is None:
            tables = self._kv.get_block_ids(request.seq_id)
            placed.table_lengths = [len(table) for table in tables]
            for table in tables:
                plan.block_table_starts.append(0)
                plan.new_block_counts.append(len(table))
                plan.new_block_ids.extend(table)
            return needs_sample
        plan.rows.append(placed.row)
        if not allocation.updates:  # the common decode: no table changed
            plan.block_table_starts.extend(lengths)
            plan.new_block_counts.extend(self._no_new_blocks)
            return needs_sample
        for g, update in enumerate(allocation.updates):
            lengths[g] = update.start + len(update.block_ids)
            plan.block_table_starts.append(update.start)
            plan.new_block_counts.append(len(update.block_ids))
            plan.new_block_ids.extend(update.block_ids)
        return needs_sample
