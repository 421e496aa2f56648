"""The plain decode message's short path (plain_decode.py) plans exactly what
the general path plans, and takes nothing else: real step messages of the
service's scheduler, applied to executor rows on the CPU, and those
messages bent one field at a time."""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pagedkv.bench.scheduler.executor_sim import (
    BLOCK_SIZE,
    VOCAB_SIZE,
    answers,
    executor_info,
    generation,
)
from pagedkv.common.errors import ServiceError
from pagedkv.executor.plain_decode import plain_decode_plan
from pagedkv.executor.rows import Rows
from pagedkv.executor.step_plan import plan_general, plan_message
from pagedkv.executor.step_types import NO_PAIRS, Limits, StepPlan
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.v1 import common_pb2, executor_pb2

NUM_ROWS = 12
MAX_MODEL_LEN = 1024


def _same(plain: StepPlan, general: StepPlan) -> None:
    for field in dataclasses.fields(StepPlan):
        a, b = getattr(plain, field.name), getattr(general, field.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, field.name
            assert (a == b).all(), field.name
        else:
            assert list(a) == list(b) if field.name == "untag_block_ids" else a == b, field.name


def _messages() -> tuple[Rows, Limits, list[tuple[executor_pb2.StepRequest, Rows]]]:
    """The scheduler's step messages for a batch of requests of several
    lengths (prefills, decodes across block boundaries, finished rows freed),
    each with a copy of the executor rows it applies to."""
    rng = random.Random(3)
    num_blocks = NUM_ROWS * (MAX_MODEL_LEN // BLOCK_SIZE) + 1
    scheduler = ExecutorScheduler(
        "e",
        executor_info(num_blocks, NUM_ROWS, max_model_len=MAX_MODEL_LEN),
        common_pb2.Owner(owner_id="t", epoch=1),
        max_num_seqs=NUM_ROWS,
        max_num_batched_tokens=256,
    )
    for key in range(2 * NUM_ROWS):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(5, 60))]
        scheduler.add(
            generation(scheduler, key + 1, prompt, rng.randrange(3, 160), None).sequences[0]
        )
    limits = Limits(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        vocab_size=VOCAB_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=256,
        max_logprobs=20,
        group_windowed=(False,),
    )
    rows = Rows(1, NUM_ROWS, MAX_MODEL_LEN // BLOCK_SIZE, MAX_MODEL_LEN, torch.device("cpu"))
    seen: list[tuple[executor_pb2.StepRequest, Rows]] = []
    inflight: deque = deque()
    for i in range(400):
        step = scheduler.schedule()
        if step is None:
            break
        message = step.request
        seen.append((message, _copy(rows)))
        plan = plan_message(message, rows, limits)
        rows.apply(plan)
        sampled = plan.rows[plan.needs_sample]
        rows.record_samples(sampled, torch.from_numpy(sampled), torch.ones(len(sampled)).long())
        inflight.extend(answers(step, i))
        while len(inflight) >= 2:
            scheduler.process(*inflight.popleft())
    return rows, limits, seen


def _copy(rows: Rows) -> Rows:
    copy = Rows(1, NUM_ROWS, MAX_MODEL_LEN // BLOCK_SIZE, MAX_MODEL_LEN, torch.device("cpu"))
    for name in ("live", "num_tokens", "num_blocks", "pending_sample"):
        getattr(copy, name)[...] = getattr(rows, name)
    copy.block_tables.copy_(rows.block_tables)
    return copy


@pytest.fixture(scope="module")
def messages() -> tuple[Limits, list[tuple[executor_pb2.StepRequest, Rows]]]:
    _, limits, seen = _messages()
    return limits, seen


def test_the_short_path_plans_what_the_general_path_plans(messages) -> None:
    limits, seen = messages
    plain_count = 0
    for message, rows in seen:
        plain = plain_decode_plan(message, rows, limits)
        if plain is None:
            continue
        plain_count += 1
        _same(plain, plan_general(message, rows, limits))
    assert plain_count > 50  # most of a running batch's messages


def _bend(message: executor_pb2.StepRequest, rows: Rows) -> list[Callable[[], None]]:
    """Ways to bend a plain decode message one field (or one row) at a time."""
    row = message.rows[0]

    def field(name: str, value: object) -> Callable[[], None]:
        return lambda: getattr(message, name).__setitem__(0, value)

    return [
        field("num_computed_tokens", message.num_computed_tokens[0] + 1),
        field("num_computed_tokens", message.num_computed_tokens[0] - 1),
        field("num_scheduled_tokens", 2),
        field("continue_from_sampled", False),
        field("needs_sample", False),
        field("block_table_starts", message.block_table_starts[0] - 1),
        field("block_table_starts", message.block_table_starts[0] + 1),
        field("new_block_counts", 1),
        field("rows", NUM_ROWS),
        field("rows", message.rows[-1]),  # a repeated row (with two entries or more)
        lambda: rows.live.__setitem__(row, False),
        lambda: rows.pending_sample.__setitem__(row, False),
        lambda: setattr(message, "num_decode_steps", 2),
        lambda: message.freed_rows.append(row),
        lambda: message.token_ids.append(5),
        lambda: message.num_computed_tokens.append(1),
        # The host tier's columns (refused here: these limits have no host tier).
        lambda: message.offload_block_ids.append(1),
        lambda: message.offload_host_block_ids.append(0),
        lambda: message.load_host_block_ids.append(0),
        lambda: message.load_block_ids.append(1),
    ]


def test_a_bent_message_is_never_taken_where_the_general_path_differs(messages) -> None:
    limits, seen = messages
    bent = 0
    for original, original_rows in seen:
        if plain_decode_plan(original, original_rows, limits) is None:
            continue
        for k in range(len(_bend(original, original_rows))):
            message = executor_pb2.StepRequest()
            message.CopyFrom(original)
            rows = _copy(original_rows)
            _bend(message, rows)[k]()
            plain = plain_decode_plan(message, rows, limits)
            try:
                general = plan_general(message, rows, limits)
            except ServiceError:
                assert plain is None, f"bend {k}: the short path took a refused message"
                bent += 1
                continue
            if plain is not None:
                _same(plain, general)
    assert bent > 100


def test_a_plain_decode_with_host_copies_goes_the_general_way(messages) -> None:
    """With a host tier, a plain decode that also offloads and loads is a
    valid message, and only the general path plans its copies."""
    limits, seen = messages
    limits = dataclasses.replace(limits, num_host_blocks=4)
    taken = 0
    for original, rows in seen:
        if plain_decode_plan(original, rows, limits) is None:
            continue
        message = executor_pb2.StepRequest()
        message.CopyFrom(original)
        message.offload_block_ids.extend([3, 1])
        message.offload_host_block_ids.extend([2, 0])
        message.load_host_block_ids.append(2)
        message.load_block_ids.append(5)
        assert plain_decode_plan(message, rows, limits) is None
        plan = plan_message(message, rows, limits)
        assert plan.offloads.tolist() == [[3, 2], [1, 0]]
        assert plan.loads.tolist() == [[2, 5]]
        _same(
            dataclasses.replace(plan, offloads=NO_PAIRS, loads=NO_PAIRS),
            plan_message(original, rows, limits),
        )
        taken += 1
    assert taken > 50
