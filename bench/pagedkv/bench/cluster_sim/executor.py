"""One simulated executor, scheduled by the service's own ``ExecutorScheduler``.

``SimExecutor`` holds what a scheduler keeps for one executor, the real
thing: an ``ExecutorScheduler`` (its block core recording cache events, its
waiting and running sequences, its policy: running sequences first in
(priority, arrival) order, preempting the least important, newest one when
a block is short, then admission with a prefix-cache lookup within the
token budget and ``max_num_seqs``). And what the executor itself keeps
across owners: its block tags (``tag_changes`` of every step's events,
oldest first), which a scheduler that takes it over adopts.

A step: ``schedule_step`` runs ``ExecutorScheduler.schedule()`` and says
what the step computes (the cost model's inputs, read from the step
message); ``finish_step``, at the step's end in simulated time, answers it
as an executor would (``executor_sim``) and applies the answer with
``ExecutorScheduler.process``. One step is in flight at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedkv.bench.cluster_sim.cost_model import prefill_pairs
from pagedkv.bench.scheduler.executor_sim import answers, apply_answers, executor_info, generation
from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind, tag_changes
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler, ScheduledStep
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.sequence import Sequence
from pagedkv.v1 import common_pb2


@dataclass(slots=True, eq=False)
class Job:
    """A request placed on an executor; ``tracked`` is the trace request it serves
    (one trace request has several jobs when it is resumed elsewhere). ``seq``:
    its sequence in the executor's scheduler, once submitted."""

    prompt_token_ids: list[int]
    max_tokens: int
    tracked: TrackedRequest
    seq: Sequence | None = None
    admitted: bool = False  # taken in once (its prefix-cache lookup counted)

    @property
    def token_ids(self) -> list[int]:
        """Its prompt and the tokens its stream delivered (a copy)."""
        return list(self.prompt_token_ids if self.seq is None else self.seq.request.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return 0 if self.seq is None else self.seq.request.num_output_tokens


@dataclass(slots=True)
class TrackedRequest:
    """A trace request's life across jobs, in simulated seconds."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_resumes: int = 0
    executors: list[int] = field(default_factory=list)


class Admission(NamedTuple):
    """A job taken in for the first time, with its prefix-cache hit."""

    job: Job
    num_prompt_tokens: int
    num_cached_tokens: int


class SimStep(NamedTuple):
    """One step sent to the executor, and what it computes."""

    scheduled: ScheduledStep
    num_prefill_tokens: int
    num_prefill_pairs: int
    decode_context_tokens: int
    num_decoding: int
    admissions: list[Admission]
    num_preemptions: int


class StepOutcome(NamedTuple):
    sampled: list[Job]  # a token each (a prompt that completed: its first)
    finished: list[Job]


class SimExecutor:
    """The scheduling state of one executor (see the module docstring)."""

    def __init__(
        self,
        index: int,
        incarnation_id: str,
        num_blocks: int,
        *,
        block_size: int,
        model_id: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.index = index
        self.incarnation_id = incarnation_id
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.info = executor_info(
            num_blocks,
            max_num_seqs,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=(num_blocks - 1) * block_size,
            model_id=model_id,
        )
        # On the executor: block id -> (hash, group), oldest tag first.
        self.tags: dict[BlockId, tuple[BlockHash, int]] = {}
        self.num_preemptions = 0
        self._keys = itertools.count(1)
        self._epoch = 0
        self._new_scheduler()

    def _new_scheduler(self, cached: Iterable[CacheEvent] = ()) -> None:
        """A scheduler's fresh state for this executor, adopting ``cached``."""
        self._epoch += 1
        self.scheduler = ExecutorScheduler(
            self.incarnation_id,
            self.info,
            common_pb2.Owner(owner_id=f"sim-{self.index}", epoch=self._epoch),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            cached=cached,
        )
        self.scheduler.listen_cache_events(self._sent_cache_events)
        self.jobs: dict[Sequence, Job] = {}  # the unfinished ones
        self._unadmitted: list[Job] = []
        self._events: list[CacheEvent] = []  # sent, not yet taken

    # -- load --------------------------------------------------------------------------

    @property
    def kv(self) -> KVCacheManager:
        """The scheduler's block core (read only)."""
        return self.scheduler.kv

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_queued(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def num_free_blocks(self) -> int:
        return self.kv.pool.get_num_free_blocks()

    # -- stepping ----------------------------------------------------------------------

    def submit(self, job: Job, now: float) -> None:
        """Queues ``job`` as a new Generate call arriving at ``now``."""
        gen = generation(
            self.scheduler, next(self._keys), job.prompt_token_ids, job.max_tokens, arrival=now
        )
        seq = gen.sequences[0]
        job.seq = seq
        self.jobs[seq] = job
        self._unadmitted.append(job)
        self.scheduler.add(seq)

    def schedule_step(self) -> SimStep | None:
        """The next step as the scheduler decides it, or None when it
        computes nothing; its cache events wait in ``take_cache_events``.
        Raises RuntimeError when requests wait and none can ever be taken in
        (a prompt larger than the pool)."""
        scheduler = self.scheduler
        num_preempted = scheduler.num_preemptions
        scheduled = scheduler.schedule()
        num_preemptions = scheduler.num_preemptions - num_preempted
        self.num_preemptions += num_preemptions
        if scheduled is None or not scheduled.num_scheduled:
            if scheduler.waiting and not scheduler.running:
                raise RuntimeError(
                    f"{scheduler.waiting[0].seq_id} needs more blocks than the pool has; "
                    "raise --num-blocks"
                )
            return None
        message = scheduled.request
        num_new = len(message.new_requests)
        num_prefill = num_pairs = context = num_decoding = 0
        entries = zip(scheduled.num_scheduled, message.num_computed_tokens, strict=True)
        for k, (num, num_computed) in enumerate(entries):
            if k < num_new or num > 1:  # a prompt's chunk (or a recompute's)
                num_prefill += num
                num_pairs += prefill_pairs(num_computed, num)
            else:  # a decode: one token over its whole context
                num_decoding += 1
                context += num_computed + 1
        admissions = []
        unadmitted = []
        for job in self._unadmitted:
            seq = job.seq
            assert seq is not None
            if not seq.admitted:
                unadmitted.append(job)
                continue
            job.admitted = True
            generation = seq.generation
            admissions.append(
                Admission(job, generation.num_prompt_tokens, generation.num_cached_prompt_tokens)
            )
        self._unadmitted = unadmitted
        return SimStep(
            scheduled,
            num_prefill_tokens=num_prefill,
            num_prefill_pairs=num_pairs,
            decode_context_tokens=context,
            num_decoding=num_decoding,
            admissions=admissions,
            num_preemptions=num_preemptions,
        )

    def finish_step(self, step: SimStep) -> StepOutcome:
        """After the step's forward: the executor's samples applied by the
        scheduler (tokens appended, finished sequences released)."""
        seqs = [seq for seq, _ in step.scheduled.sampled]
        sampled = [self.jobs[seq] for seq in seqs]
        apply_answers(self.scheduler, answers(step.scheduled, self.scheduler.step_id))
        finished = [self.jobs.pop(seq) for seq in seqs if seq.finished]
        return StepOutcome(sampled, finished)

    def _sent_cache_events(self, events: list[CacheEvent]) -> None:
        """The events a step sends (or the pool's, see ``take_cache_events``),
        applied to the executor's tags as the executor applies them."""
        if not events:
            return
        changes = tag_changes(events)
        tags = self.tags
        for block_id in changes.untag:
            tags.pop(BlockId(block_id), None)
        for event in changes.tags:
            tags.pop(event.block_id, None)
            tags[event.block_id] = (event.block_hash, event.group_id)
        self._events.extend(events)

    def take_cache_events(self) -> list[CacheEvent]:
        """The events sent since the last call, and the pool's not sent yet
        (the real scheduler sends those with its next step)."""
        self._sent_cache_events(self.kv.pool.take_events())
        events, self._events = self._events, []
        return events

    # -- owners ------------------------------------------------------------------------

    def lose_owner(self) -> list[Job]:
        """Its scheduler died: every unfinished job comes back (with the tokens
        its stream delivered) for the client to resume elsewhere; the tags stay."""
        self.take_cache_events()
        jobs = [self.jobs[seq] for seq in self.scheduler.sequences]
        self._new_scheduler()
        return jobs

    def adopt(self) -> list[BlockHash]:
        """A surviving scheduler takes it over with its cache: a fresh
        scheduler's pool adopts the tagged blocks, oldest first. Returns the
        hashes adopted."""
        cached = [
            CacheEvent(CacheEventKind.STORED, block_id, block_hash, group_id)
            for block_id, (block_hash, group_id) in self.tags.items()
        ]
        self._new_scheduler(cached)
        self.take_cache_events()
        return list(self.kv.pool.cached_blocks[0])
