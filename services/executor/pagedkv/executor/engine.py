"""The executor's state machine behind the gRPC API: fencing, rows and steps.

One lock serialises every call that reads or changes rows, so the step stream
and the unary calls see one order. Each call is validated in whole (owner,
then ``plan_message``) before anything changes; a refused call changes
nothing.

Fencing (fencing.py): the executor has at most one owner ``(owner_id,
epoch)``, set by ``reset``; mutating calls must carry exactly the current
owner. A reset, by a new owner (a higher epoch) or by the current one (a
restart of its session), frees every row and ends open step streams (their
session number changes); KV contents are kept, and so are the block tags
unless the reset asks to drop them.

Steps are launched and completed (launched.py): ``launch`` applies a step and
enqueues its device work, ``complete`` waits for it and makes the response,
so a stream can launch step N + 1 while the device runs step N
(step_pipeline.py). Launch and completion keep the steps' order.

A step's host tier copies (host_kv.py: offloads, then loads) are enqueued
before anything else of it; each layer of its forward waits for that
layer's part of the loads (the model runner lands them), and for an
offload only when it writes into that block (a table update, a copy's
destination; an Allocate's and a CopyBlocks' blocks likewise). The pool
keeps its blocks across resets.

Block tags (see block_tags.py): a step's untags, and the destinations of its
loads and copies, lose their tags before the step changes anything else; its
tags are set when it completes, or earlier when a later call touches tags (in
launch order either way). ``list_cached_blocks`` waits for the device and
snapshots them under the lock, so every listed tag's KV has been written and
no step interleaves.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedkv.common.errors import FailedPrecondition
from pagedkv.common.ids import BlockId
from pagedkv.common.logging import get_logger
from pagedkv.common.step_trace import step_trace
from pagedkv.executor.block_store import move_blocks
from pagedkv.executor.block_tags import LIST_CHUNK_SIZE, BlockTags, listing
from pagedkv.executor.executor_info import info_response
from pagedkv.executor.fencing import check_current, check_owner_fields, check_takeover
from pagedkv.executor.launched import (
    TRACE_FIELDS,
    DeviceOrigin,
    HostSamples,
    LaunchedStep,
    device_clock,
    release_clocks,
)
from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.sampler import SamplerOutput
from pagedkv.executor.step_plan import plan_copies, plan_message
from pagedkv.v1 import common_pb2, executor_pb2

log = get_logger(__name__)


DRAIN_IDLE_S = 2.0
"""A draining executor whose live rows nobody has stepped for this long
stops: a running row is stepped every few milliseconds while its owner
lives."""


class Executor:
    """One model on one device, driven by one owner at a time."""

    def __init__(self, runner: ModelRunner, model_id: str) -> None:
        self.runner = runner
        self.model_id = model_id
        self.incarnation_id = uuid.uuid4().hex
        self.owner = common_pb2.Owner()
        self.session = 0  # bumped by every reset: open streams of older sessions end
        self.lock = threading.Lock()
        self.tags = BlockTags()  # written only here, under the lock
        self.host_tags = BlockTags()  # the host tier's blocks (host block ids), likewise
        self.drain_deadline: float | None = None  # time.monotonic() when it stops
        self.last_step_at = time.monotonic()
        self._num_launched = 0
        # Launched steps whose tags are not set yet, in launch order: a step's
        # tags go in once it has completed on the device, or before anything
        # later touches tags (see ``_settle_tags``).
        self._untagged: deque[LaunchedStep] = deque()
        # Called once when draining starts (the server turns its health NOT_SERVING).
        self.on_draining: list[Callable[[], None]] = []
        self.trace = step_trace("executor", TRACE_FIELDS)  # None unless measuring
        self._device_origin = DeviceOrigin(runner.device) if self.trace is not None else None

    # -- draining -------------------------------------------------------------

    def drain(self, timeout: float) -> None:
        """Starts stopping (SIGTERM): every later step and GetInfo says so,
        so the owner admits nothing new here and lets the rows finish. The
        caller waits for ``num_live_rows`` to reach 0 or ``timeout`` to pass.
        Idempotent (the first deadline holds)."""
        if self.drain_deadline is not None:
            return
        self.drain_deadline = time.monotonic() + timeout
        for hook in self.on_draining:
            hook()

    def drained(self) -> bool:
        """True once the owner has nothing left here: no row is live, or
        rows are live but nobody has stepped them for ``DRAIN_IDLE_S`` (their
        owner is gone or gave them up, so nothing will finish them)."""
        with self.lock:
            live = bool(self.runner.rows.live.any())
            return not live or time.monotonic() - self.last_step_at > DRAIN_IDLE_S

    @property
    def num_live_rows(self) -> int:
        with self.lock:
            return int(self.runner.rows.live.sum())

    def _drain_fields(self) -> dict[str, Any]:
        if self.drain_deadline is None:
            return {}
        left = max(0.0, self.drain_deadline - time.monotonic())
        return {"draining": True, "drain_seconds_left": left}

    # -- fencing --------------------------------------------------------------

    def check_owner(self, owner: common_pb2.Owner) -> None:
        """FailedPrecondition unless ``owner`` is the current owner."""
        check_current(owner, self.owner)

    def reset(self, request: executor_pb2.ResetRequest) -> executor_pb2.ResetResponse:
        owner = request.owner
        check_owner_fields(owner)
        with self.lock:
            check_takeover(owner, self.owner)
            previous = common_pb2.Owner()
            previous.CopyFrom(self.owner)
            self.owner.CopyFrom(owner)
            self.session += 1
            self._settle_tags()  # steps of the old session launched before the reset
            rows = self.runner.rows
            if len(self.tags):  # the live rows' blocks were in use until now
                self.tags.touch(rows.released_blocks(np.flatnonzero(rows.live).tolist()))
            freed = rows.free_all()
            dropped_tags = self.tags.clear() if request.drop_cached_blocks else 0
            if request.drop_cached_blocks:
                self.host_tags.clear()
            num_tags = len(self.tags)
        log.info(
            "executor reset",
            owner=owner.owner_id,
            epoch=owner.epoch,
            previous=previous.owner_id,
            freed_rows=len(freed),
            tagged_blocks=num_tags,
            dropped_tags=dropped_tags,
        )
        return executor_pb2.ResetResponse(
            previous_owner=previous, incarnation_id=self.incarnation_id
        )

    # -- reads ----------------------------------------------------------------

    def get_info(self) -> executor_pb2.GetInfoResponse:
        with self.lock:
            self._settle_tags()
            num_tagged_blocks = len(self.tags)
        return info_response(
            self.runner,
            self.model_id,
            self.incarnation_id,
            self.owner,
            num_tagged_blocks,
            draining=self.drain_deadline is not None,
        )

    def list_cached_blocks(
        self, request: executor_pb2.ListCachedBlocksRequest
    ) -> list[executor_pb2.ListCachedBlocksResponse]:
        """The tags, least recently tagged or released first, in chunks of at
        most ``LIST_CHUNK_SIZE``; only for the current owner. The snapshot is
        taken under the lock (no step interleaves); the messages are built
        after it."""
        with self.lock:
            self.check_owner(request.owner)
            self._wait_for_device()  # a listed tag's KV has been written
            self._settle_tags()
            chunks = self.tags.chunks(LIST_CHUNK_SIZE)
            host_chunks = self.host_tags.chunks(LIST_CHUNK_SIZE)
        return listing(chunks, host_chunks)

    # -- mutations ------------------------------------------------------------

    def allocate(self, request: executor_pb2.AllocateRequest) -> executor_pb2.AllocateResponse:
        with self.lock:
            self.check_owner(request.owner)
            plan = plan_message(request, self.runner.rows, self.runner.limits)
            self.runner.rows.apply(plan)
            if self.runner.host_kv is not None:  # later steps write into its blocks
                self.runner.host_kv.before_writes(plan.table_block_ids)
        return executor_pb2.AllocateResponse()

    def free(self, request: executor_pb2.FreeRequest) -> executor_pb2.FreeResponse:
        with self.lock:
            self.check_owner(request.owner)
            rows = self.runner.rows
            wanted = {row for row in request.rows if row < rows.max_num_rows and rows.live[row]}
            wanted |= {rows.row_of_seq[r] for r in request.seq_ids if r in rows.row_of_seq}
            freed = sorted(wanted)
            self._settle_tags()
            if len(self.tags):
                self.tags.touch(rows.released_blocks(freed))
            rows.free(freed)
        return executor_pb2.FreeResponse(freed_rows=freed)

    def copy_blocks(
        self, request: executor_pb2.CopyBlocksRequest
    ) -> executor_pb2.CopyBlocksResponse:
        with self.lock:
            self.check_owner(request.owner)
            copies = plan_copies(
                request.src_block_ids,
                request.dst_block_ids,
                self.runner.limits,
                ("src_block_ids", "dst_block_ids"),
            )
            self._settle_tags()
            if len(self.tags):
                self.tags.untag([BlockId(b) for b in copies[:, 1].tolist()])
            if self.runner.host_kv is not None and len(copies):
                self.runner.host_kv.before_writes(copies[:, 1])
            self.runner.copy_blocks(copies)
        return executor_pb2.CopyBlocksResponse()

    def step(
        self, request: executor_pb2.StepRequest, session: int | None = None
    ) -> executor_pb2.StepResponse:
        """Validates, applies and runs one step and waits for its response;
        ``session`` (for streams) must still be current."""
        return self.complete(self.launch(request, session))

    def launch(self, request: executor_pb2.StepRequest, session: int | None = None) -> LaunchedStep:
        """Validates and applies a step and enqueues its device work, without
        waiting for the device: ``complete`` makes its response. Steps launch
        and complete in one order; a later step may launch before an earlier
        one completes (it continues from the earlier one's samples on the
        device)."""
        received = time.perf_counter()
        thread_cpu = time.thread_time()
        with self.lock:
            if session is not None and session != self.session:
                raise FailedPrecondition("the executor was reset: this step stream is over")
            self.check_owner(request.owner)
            self.last_step_at = time.monotonic()
            runner = self.runner
            plan = plan_message(request, runner.rows, runner.limits)
            planned = time.perf_counter()
            start = device_clock(runner.device)
            self._settle_tags()  # earlier steps' tags come before this step's untags
            if runner.host_kv is not None:  # before all else
                self.host_tags.take_tags(self.tags, plan.offloads)
                # Loaded host blocks become the most recently used, as the
                # scheduler's host index makes them (an adopter's eviction order).
                if len(plan.loads):
                    self.host_tags.touch(plan.loads[:, 0].tolist())
                move_blocks(
                    runner.host_kv,
                    plan.offloads,
                    plan.loads,
                    plan.table_block_ids,
                    plan.copies[:, 1],
                )
            # The freed rows' blocks, the newest released once its tags are set.
            released = runner.rows.released_blocks(plan.freed_rows) if plan.freed_rows else []
            tags = self.tags
            if len(tags):
                if plan.untag_block_ids:
                    tags.untag(plan.untag_block_ids)
                for written in (plan.loads, plan.copies):  # their destinations lose their tags
                    if len(written):
                        tags.untag([BlockId(b) for b in written[:, 1].tolist()])
            self.runner.rows.apply(plan)
            applied = time.perf_counter()
            result = runner.run(plan)
            ran = time.perf_counter()
            samples = None
            sampled_rows = plan.rows[plan.needs_sample]
            if plan.num_steps > 1:  # a decode window: its steps' samples, in turn
                sampled_rows = np.tile(sampled_rows, plan.num_steps)
            if result is not None:
                samples = HostSamples(result, self._num_logprobs(sampled_rows, result))
            self._num_launched += 1
            launched = LaunchedStep(
                sequence=self._num_launched,
                step_id=request.step_id,
                received=received,
                sampled_rows=sampled_rows if result is not None else sampled_rows[:0],
                samples=samples,
                tags=plan.tags,
                released=released,
                start=start,
                end=device_clock(runner.device),
                num_steps=plan.num_steps,
                phases=(planned, applied, ran),
                launched=time.perf_counter(),
                launch_cpu=time.thread_time() - thread_cpu,
                host_copies=(len(plan.offloads), len(plan.loads)),
            )
            if plan.tags.block_ids or released:
                self._untagged.append(launched)
        return launched

    def complete(self, launched: LaunchedStep) -> executor_pb2.StepResponse:
        """Waits for a launched step on the device and makes its response; its
        tags (and those of steps launched before it) are set now at the latest."""
        launched.wait()
        done = time.perf_counter()
        response = executor_pb2.StepResponse(step_id=launched.step_id, **self._drain_fields())
        if launched.samples is not None:
            launched.samples.fill(launched.sampled_rows, response)
        response.device_time_us = launched.device_time_us()
        trace, origin = self.trace, self._device_origin
        span = origin.span(launched) if origin is not None else ()
        release_clocks(launched)
        if self._untagged and self._untagged[0].sequence <= launched.sequence:
            with self.lock:
                self._settle_tags(launched.sequence)
        completed = time.perf_counter()
        response.host_time_us = int((completed - launched.received) * 1e6)
        if self.runner.host_kv is not None:
            offloads, loads = self.runner.host_kv.copy_seconds()
            response.host_offload_time_us = int(offloads * 1e6)
            response.host_load_time_us = int(loads * 1e6)
        if trace is not None:
            trace.add(
                launched.step_id,
                len(launched.sampled_rows) // launched.num_steps,
                launched.num_steps,
                launched.received,
                *launched.phases,
                launched.launched,
                launched.launch_cpu,
                done,
                completed,
                *span,
                time.process_time(),
                *launched.host_copies,
            )
        return response

    def _settle_tags(self, up_to: int | None = None) -> None:
        """Sets the pending tags of launched steps, in launch order (all, or
        those launched up to ``up_to``), each step's followed by its freed
        rows' blocks moving to the end of the order (a block a finishing
        request completed is tagged in the step that frees its row). Under
        the lock."""
        pending = self._untagged
        while pending and (up_to is None or pending[0].sequence <= up_to):
            launched = pending.popleft()
            self.tags.tag(*launched.tags)
            self.tags.touch(launched.released)

    def _wait_for_device(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _num_logprobs(self, rows: np.ndarray, result: SamplerOutput) -> list[int]:
        """Top logprobs each sampled row asked for (none when none did)."""
        if not result.top_token_ids.shape[1]:
            return []
        sampling = self.runner.rows.sampling
        return [s.num_logprobs if (s := sampling[row]) else 0 for row in rows.tolist()]
