"""A step as data, and its wire messages.

``ExecutorScheduler.schedule`` decides a step and records what it decided in
a ``StepPlan`` (plain columns, one value per entry, in wire order: new
requests first); ``encode_step`` turns a plan into the ``StepRequest``s to
send. Encoding changes nothing: every state change of a step (computed
counts, rows' table lengths, the queues of copies and cache events drained,
step ids taken) is made by the scheduler before the plan exists.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from pagedkv.common.ids import BlockId
from pagedkv.common.step_contract import ONE_STEP
from pagedkv.scheduler.cache_events import CacheEvent, tag_changes
from pagedkv.scheduler.host_tier import HostCopy
from pagedkv.scheduler.kv_cache_types import BlockCopy
from pagedkv.scheduler.sequence import ExecutorRow, Sequence
from pagedkv.v1 import common_pb2, executor_pb2


@dataclass(frozen=True, slots=True)
class NewRequestPlan:
    """A sequence the executor does not know yet: sent whole, once."""

    seq_id: str
    row: int
    token_ids: array[int]  # a copy of the request's whole history
    sampling: common_pb2.SamplingParams
    num_prompt_tokens: int  # of token_ids, the prompt (outputs count from there)


@dataclass(slots=True)
class StepPlan:
    """Everything a step sends, as plain values (see the module docstring).

    ``copy_phases``: copy-on-write copies in phases (see ``copy_phases``), the
    last one in the step itself, the earlier ones each in a copy-only message
    sent first; ``first_step_id`` numbers those messages in order.
    ``offloads`` and ``loads``: the host tier's copies (host_tier.py), in the
    first message, which runs them before anything else. Per entry
    (``new_requests`` then ``rows``): the columns of ``StepRequest``; per entry
    and group: ``block_table_starts`` and ``new_block_counts``.
    """

    first_step_id: int
    copy_phases: list[list[BlockCopy]]
    untag_block_ids: list[int]
    tag_block_ids: list[BlockId]
    tag_block_hashes: list[bytes]
    tag_group_ids: list[int]
    freed_rows: list[int]
    offloads: list[HostCopy] = field(default_factory=list)  # the host tier's copies
    loads: list[HostCopy] = field(default_factory=list)
    new_requests: list[NewRequestPlan] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    continue_from_sampled: list[bool] = field(default_factory=list)
    needs_sample: list[bool] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_table_starts: list[int] = field(default_factory=list)
    new_block_counts: list[int] = field(default_factory=list)
    new_block_ids: list[BlockId] = field(default_factory=list)
    num_decode_steps: int = ONE_STEP  # a decode window's steps (see windows.py)

    @classmethod
    def start(
        cls,
        first_step_id: int,
        copies: list[BlockCopy],
        events: list[CacheEvent],
        freed_rows: list[int],
    ) -> StepPlan:
        """A plan with no entries yet: the copy-on-write ``copies`` made for
        the step, in phases (see ``copy_phases``), the executor's tag changes
        for the cache ``events`` logged since the last step, the rows freed."""
        untag, tags = tag_changes(events) if events else ([], [])
        return cls(
            first_step_id=first_step_id,
            copy_phases=copy_phases(copies),
            untag_block_ids=untag,
            tag_block_ids=[t.block_id for t in tags],
            tag_block_hashes=[t.block_hash for t in tags],
            tag_group_ids=[t.group_id for t in tags],
            freed_rows=freed_rows,
        )


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """A step's message, and what applying its response needs.

    ``num_scheduled``: tokens per entry, in wire order. ``sampled``: per
    sample the step asks for, in entry order (the order of the response's
    samples), the sequence and its executor state when scheduled (a release
    replaces that, so a later response no longer applies to it).
    ``before``: copy-only messages to send first, in order (see
    ``copy_phases``); usually none."""

    request: executor_pb2.StepRequest
    num_scheduled: list[int] = field(default_factory=list)
    sampled: list[tuple[Sequence, ExecutorRow]] = field(default_factory=list)
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


def _copy_message(
    owner: common_pb2.Owner, step_id: int, copies: list[BlockCopy]
) -> executor_pb2.StepRequest:
    return executor_pb2.StepRequest(
        owner=owner,
        step_id=step_id,
        copy_src_block_ids=[c.src for c in copies],
        copy_dst_block_ids=[c.dst for c in copies],
    )


def encode_step(
    owner: common_pb2.Owner, plan: StepPlan
) -> tuple[tuple[executor_pb2.StepRequest, ...], executor_pb2.StepRequest]:
    """The copy-only messages to send first, and the step's message."""
    *early, copies = plan.copy_phases
    step_id = plan.first_step_id
    before = []
    for phase in early:  # rare: see copy_phases
        before.append(_copy_message(owner, step_id, phase))
        step_id += 1
    message = _copy_message(owner, step_id, copies)
    first = before[0] if before else message
    if plan.untag_block_ids:
        # Untags go in the first message that may write into a block.
        first.untag_block_ids.extend(plan.untag_block_ids)
    if plan.offloads or plan.loads:  # before anything writes into a block, too
        first.offload_block_ids.extend([c.block_id for c in plan.offloads])
        first.offload_host_block_ids.extend([c.host_id for c in plan.offloads])
        first.load_host_block_ids.extend([c.host_id for c in plan.loads])
        first.load_block_ids.extend([c.block_id for c in plan.loads])
    message.tag_block_ids.extend(plan.tag_block_ids)
    message.tag_block_hashes.extend(plan.tag_block_hashes)
    message.tag_group_ids.extend(plan.tag_group_ids)
    message.freed_rows.extend(plan.freed_rows)
    for new in plan.new_requests:
        message.new_requests.add(
            seq_id=new.seq_id,
            row=new.row,
            prompt_token_ids=new.token_ids,
            sampling=new.sampling,
            num_prompt_tokens=new.num_prompt_tokens,
        )
    message.rows.extend(plan.rows)
    message.num_scheduled_tokens.extend(plan.num_scheduled_tokens)
    message.num_computed_tokens.extend(plan.num_computed_tokens)
    message.continue_from_sampled.extend(plan.continue_from_sampled)
    message.needs_sample.extend(plan.needs_sample)
    message.token_ids.extend(plan.token_ids)
    message.block_table_starts.extend(plan.block_table_starts)
    message.new_block_counts.extend(plan.new_block_counts)
    message.new_block_ids.extend(plan.new_block_ids)
    if plan.num_decode_steps > ONE_STEP:  # one step: left unset
        message.num_decode_steps = plan.num_decode_steps
    return tuple(before), message
