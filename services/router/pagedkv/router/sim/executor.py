"""One simulated executor and the scheduling of its steps, over the real block core.

``SimExecutor`` holds what a scheduler keeps for one executor: a
``KVCacheManager`` recording cache events, the decoding requests (oldest
first), the partly prefilled ones and a waiting queue; and what the
executor itself keeps across owners: its block tags (``tag_changes`` of every
step's events, oldest first), which a scheduler that takes it over adopts.

A step follows the scheduler's order: every decoding request gets a slot for
one token, in order, through ``KVCacheManager.allocate_decode_slots`` as the
service's scheduler calls it (preempting the newest running request while a
block is short), partly prefilled prompts take their next chunk, then
waiting requests are admitted with a prefix-cache lookup while the token
budget and ``max_num_seqs`` allow. ``plan_step`` makes those block-core calls
and says what the step computes (its cost inputs); ``finish_step``, at the
step's end in simulated time, appends the sampled tokens and frees finished
requests (in running order, as the scheduler releases them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.common.kv_cache_spec import KVCacheSpec
from pagedkv.router.sim.cost_model import prefill_pairs
from pagedkv.scheduler.cache_events import CacheEvent, CacheEventKind, tag_changes
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import Request, RequestStatus

VOCAB_SIZE = 32_000


@dataclass(slots=True)
class Job:
    """A request placed on an executor; ``tracked`` is the trace request it serves
    (one trace request has several jobs when it is resumed elsewhere)."""

    request: Request
    tracked: TrackedRequest
    admitted: bool = False  # taken in once (its prefix-cache lookup counted)


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


class StepPlan(NamedTuple):
    """What one planned step computes."""

    num_prefill_tokens: int
    num_prefill_pairs: int
    decode_context_tokens: int
    num_decoding: int
    chunks: list[tuple[Job, int]]  # prefill chunks: job, tokens
    admissions: list[Admission]
    num_preemptions: int
    cache_events: list[CacheEvent]  # the pool's events since the last plan


class StepOutcome(NamedTuple):
    first_tokens: list[Job]  # jobs whose prompt completed (their next token was sampled)
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
        self.num_blocks = num_blocks
        self.spec = KVCacheSpec(block_size, 16, 8, 64, "bfloat16")
        self.model_id = model_id
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # On the executor: block id -> (hash, group), oldest tag first.
        self.tags: dict[BlockId, tuple[BlockHash, int]] = {}
        self.num_preemptions = 0
        self._new_scheduler()

    def _new_scheduler(self) -> None:
        """A scheduler's fresh state for this executor (its cache adopted by the caller)."""
        self.kv = KVCacheManager(
            [self.spec], self.num_blocks, model_id=self.model_id, record_events=True
        )
        # Prompt done, one token per step: the requests, oldest first, and their jobs.
        self.decoding: list[Request] = []
        self._decoding_jobs: dict[str, Job] = {}
        self.prefilling: list[Job] = []
        self.waiting: deque[Job] = deque()

    # -- load --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    @property
    def num_queued(self) -> int:
        return self.num_running + len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def num_free_blocks(self) -> int:
        return self.kv.pool.get_num_free_blocks()

    # -- stepping ----------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        self.waiting.append(job)

    def _preempt_newest(self) -> None:
        if self.prefilling:
            job = self.prefilling.pop()
        else:
            job = self._decoding_jobs.pop(self.decoding.pop().seq_id)
        self.kv.free(job.request)
        job.request.num_computed_tokens = 0
        job.request.status = RequestStatus.PREEMPTED
        job.request.num_preemptions += 1
        self.waiting.appendleft(job)
        self.num_preemptions += 1

    def plan_step(self) -> StepPlan:
        """Allocates this step's blocks (see the module docstring)."""
        kv = self.kv
        num_preempted = self.num_preemptions
        requests = self.decoding
        num_allocated = 0
        while True:  # on a miss: preempt, then go on from the request that missed
            num_allocated += kv.allocate_decode_slots(requests, num_allocated).num_allocated
            if num_allocated == len(requests):
                break
            self._preempt_newest()
        num_decoding = len(requests)
        decode_context = sum(request.num_tokens for request in requests)
        budget = self.max_num_batched_tokens - num_decoding
        chunks: list[tuple[Job, int]] = []
        num_pairs = 0
        for job in self.prefilling:
            request = job.request
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or kv.allocate_slots(request, num_new) is None:
                break
            chunks.append((job, num_new))
            num_pairs += prefill_pairs(request.num_computed_tokens, num_new)
            budget -= num_new
        admissions: list[Admission] = []
        num_running = num_decoding + len(self.prefilling)
        while (
            num_preempted == self.num_preemptions
            and self.waiting
            and budget > 0
            and num_running < self.max_num_seqs
        ):
            job = self.waiting[0]
            request = job.request
            computed = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            if kv.allocate_slots(request, num_new, computed) is None:
                if not num_running:
                    raise RuntimeError(
                        f"{request.seq_id} needs more blocks than the pool has; raise --num-blocks"
                    )
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if not job.admitted:
                job.admitted = True
                admissions.append(Admission(job, request.num_tokens, computed.num_tokens))
            self.prefilling.append(job)
            chunks.append((job, num_new))
            num_pairs += prefill_pairs(computed.num_tokens, num_new)
            budget -= num_new
            num_running += 1
        return StepPlan(
            num_prefill_tokens=sum(n for _, n in chunks),
            num_prefill_pairs=num_pairs,
            decode_context_tokens=decode_context,
            num_decoding=num_decoding,
            chunks=chunks,
            admissions=admissions,
            num_preemptions=self.num_preemptions - num_preempted,
            cache_events=self.take_cache_events(),
        )

    def finish_step(self, plan: StepPlan) -> StepOutcome:
        """After the step's forward: sampled tokens, finished requests, finished prompts."""
        finished: list[Job] = []
        first_tokens: list[Job] = []
        if plan.num_decoding:
            for request in self.decoding:
                request.num_computed_tokens += 1
                request.append_output_token_ids(request.num_tokens * 40503 % VOCAB_SIZE)
                if request.num_output_tokens == request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    self.kv.free(request)
                    finished.append(self._decoding_jobs.pop(request.seq_id))
            if finished:
                self.decoding = [r for r in self.decoding if not r.status.is_finished]
        for job, num_new in plan.chunks:
            request = job.request
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                self.prefilling.remove(job)
                request.append_output_token_ids(request.num_tokens * 40503 % VOCAB_SIZE)
                first_tokens.append(job)
                if request.num_output_tokens == request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    self.kv.free(request)
                    finished.append(job)
                else:
                    self.decoding.append(request)
                    self._decoding_jobs[request.seq_id] = job
        return StepOutcome(first_tokens, finished)

    def take_cache_events(self) -> list[CacheEvent]:
        """The pool's events since the last call, applied to the executor's tags
        (the real scheduler sends them with the step)."""
        events = self.kv.pool.take_events()
        if events:
            changes = tag_changes(events)
            tags = self.tags
            for block_id in changes.untag:
                tags.pop(BlockId(block_id), None)
            for event in changes.tags:
                tags.pop(event.block_id, None)
                tags[event.block_id] = (event.block_hash, event.group_id)
        return events

    # -- owners ------------------------------------------------------------------------

    def lose_owner(self) -> list[Job]:
        """Its scheduler died: every unfinished job comes back (with the tokens
        its stream delivered) for the client to resume elsewhere; the tags stay."""
        self.take_cache_events()
        decoding = [self._decoding_jobs[request.seq_id] for request in self.decoding]
        jobs = [*self.prefilling, *decoding, *self.waiting]
        self._new_scheduler()
        self.kv.pool.take_events()
        return jobs

    def adopt(self) -> list[BlockHash]:
        """A surviving scheduler takes it over with its cache: a fresh pool
        adopts the tagged blocks, oldest first. Returns the hashes adopted."""
        self._new_scheduler()
        cached = [
            CacheEvent(CacheEventKind.STORED, block_id, block_hash, group_id)
            for block_id, (block_hash, group_id) in self.tags.items()
        ]
        self.kv.pool.adopt_cached_blocks(cached)
        self.take_cache_events()
        return list(self.kv.pool.cached_blocks[0])
