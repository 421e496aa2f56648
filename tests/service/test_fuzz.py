"""Stateful fuzzing of the Scheduler API against the live stack: one
``pagedkv serve`` with two CPU executors on the tiny llama and pools small
enough to preempt, kept for the module. Hypothesis draws bursts of
concurrent operations (``fuzz_ops.py``): Generate calls with colliding,
separated, unicode and over-long request ids, n up to 4, beam search, stop
tokens, logprobs, deadlines, priorities and client cancels; Abort of live
and unknown ids; GetStats at any moment. Each burst runs on one asyncio
loop through grpc.aio; then:

- every operation ended with a status it may end with, and every stream
  either ended OK after one chunk carrying ``usage`` or with a non-OK
  status, its chunks well formed (``fuzz_checks.py``); no call hangs (each
  is bounded by a generous deadline of the suite's when it has none of its
  own, and reaching that bound is a failure);
- the service still answers a fresh Generate, every executor is healthy,
  and once every call has ended the stack settles with nothing running or
  waiting, every block free and its pools sound.

A failing burst is reported with every operation, how it ended, and the
warnings and errors the stack logged meanwhile; a stack a burst left
unusable is restarted before the next burst, so that shrinking stays
meaningful. Bursts that once broke the service run first, as explicit
examples.

Profiles: by default (CI) 120 bursts of up to 16 operations, derandomized:
the same bursts on every run. ``PAGEDKV_FUZZ_EXAMPLES=N`` selects the long
profile: N random bursts of up to 24 operations, failures remembered in the
hypothesis database and printed with a blob for ``@reproduce_failure``
(``--hypothesis-seed`` repeats a run).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from pagedkv.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.executor.test_generation import model_dirs
from tests.service.fuzz_checks import (
    Outcome,
    check_abort,
    check_greedy_agreement,
    check_stats,
    check_status,
    check_stream,
    stats_problems,
)
from tests.service.fuzz_ops import NUM_BLOCKS, Abort, Burst, Generate, Stats, bursts, sized_id
from tests.service.stack import Process, serve

pytestmark = pytest.mark.slow  # the live stack under random bursts of every kind of call

__all__ = ["model_dirs"]  # the session fixture, shared with the executor tests

GENEROUS_S = 60.0  # the deadline of a call without its own: reaching it means it hung
SETTLE_S = 60.0  # how long ends may take to reach the pools once every call has ended
LONG_EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "0"))
MAX_OPERATIONS = 24 if LONG_EXAMPLES else 16
MAX_EXAMPLES = LONG_EXAMPLES or 120
PROFILE = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=not LONG_EXAMPLES,  # which implies no database
    print_blob=bool(LONG_EXAMPLES),
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large),
)


class Stack:
    """The module's ``pagedkv serve``, started on first use and restarted
    when a burst left it unusable (dead, an executor down, or not settled)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.process: Process | None = None

    def __repr__(self) -> str:
        return f"Stack(executors=2, num_blocks={NUM_BLOCKS})"

    def ready(self) -> Process:
        process = self.process
        if process is not None and process.process.poll() is None and not settle(process):
            return process
        if process is not None:
            process.close()
        self.process = serve(self.model_dir, executors=2, num_blocks=NUM_BLOCKS, log_format="json")
        return self.process

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


@pytest.fixture(scope="module")
def fuzz_stack(model_dirs: dict[str, Path]) -> Iterator[Stack]:
    stack = Stack(model_dirs["llama"])
    yield stack
    stack.close()


async def run_generate(
    stub: scheduler_pb2_grpc.SchedulerStub, op: Generate, outcome: Outcome, first: asyncio.Event
) -> None:
    """Streams one Generate into ``outcome``, cancelling it after
    ``op.cancel_after`` chunks; ``first`` is set at the first chunk."""
    call = stub.Generate(op.request(), timeout=op.deadline_s or GENEROUS_S)
    while True:
        complete = bool(outcome.chunks) and outcome.chunks[-1].HasField("usage")
        if op.cancel_after is not None and len(outcome.chunks) >= op.cancel_after and not complete:
            outcome.cancelled = call.cancel()
            break
        chunk = await call.read()
        if chunk is grpc.aio.EOF:
            break
        outcome.chunks.append(chunk)
        first.set()
    outcome.code = await call.code()
    outcome.details = await call.details() or ""


async def run_burst(target: str, burst: Burst) -> list[Outcome]:
    """Starts every operation of ``burst`` at once (each waits for the
    operation it comes after, then its delay); their outcomes, in order."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        loop = asyncio.get_running_loop()
        origin = loop.time()
        firsts = [asyncio.Event() for _ in burst.operations]  # first chunk, or the end

        async def run(i: int, op: Generate | Abort | Stats) -> Outcome:
            if op.after is not None:
                await firsts[op.after].wait()
            await asyncio.sleep(op.delay_s)
            outcome = Outcome(op, start=loop.time() - origin)
            try:
                if isinstance(op, Generate):
                    await run_generate(stub, op, outcome, firsts[i])
                elif isinstance(op, Abort):
                    abort = scheduler_pb2.AbortRequest(request_id=op.request_id)
                    outcome.aborted = (await stub.Abort(abort, timeout=GENEROUS_S)).aborted
                else:
                    stats = scheduler_pb2.GetStatsRequest()
                    outcome.stats = await stub.GetStats(stats, timeout=GENEROUS_S)
            except grpc.aio.AioRpcError as exc:
                outcome.code, outcome.details = exc.code(), exc.details() or ""
            finally:
                outcome.end = loop.time() - origin
                firsts[i].set()
            return outcome

        return list(await asyncio.gather(*(run(i, op) for i, op in enumerate(burst.operations))))


def still_answers(process: Process) -> list[str]:
    """A fresh small Generate (an id of the scheduler's own) completes."""
    sampling = common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    request = scheduler_pb2.GenerateRequest(
        token_ids=scheduler_pb2.TokenIds(ids=list(b"still there?")), sampling=sampling
    )
    try:
        chunks = list(process.stub.Generate(request, timeout=GENEROUS_S))
    except grpc.RpcError as exc:
        return [f"a fresh Generate failed: {exc.code().name} {exc.details()!r}"]
    if not chunks or chunks[-1].usage.completion_tokens != 3:
        return [f"a fresh Generate ended without its 3 tokens: {chunks[-1:]}"]
    return []


def settle(process: Process) -> list[str]:
    """Polls GetStats until nothing runs, waits or holds a block; what is
    still wrong after ``SETTLE_S`` (or at once, for a sick pool or executor)."""
    stop = time.monotonic() + SETTLE_S
    while True:
        try:
            stats = process.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=GENEROUS_S)
        except grpc.RpcError as exc:
            return [f"GetStats failed: {exc.code().name} {exc.details()!r}"]
        problems = stats_problems(stats)
        held = [
            f"{e.address} has {e.num_free_blocks} of {e.num_blocks - 1} blocks free"
            for e in stats.executors
            if e.num_free_blocks != e.num_blocks - 1
        ]
        if stats.num_running or stats.num_waiting:
            held.append(f"{stats.num_running} running, {stats.num_waiting} waiting")
        if problems or not held:
            return problems
        if time.monotonic() > stop:
            return [f"not settled after every call ended: {'; '.join(held)}"]
        time.sleep(0.05)


def log_excerpt(log: str, limit: int = 40) -> str:
    """The warnings and errors among the stack's JSON log lines, with each
    exception's last line."""
    records = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # progress bars
        if not isinstance(record, dict):
            continue
        level = record.pop("level", "")
        exception = record.pop("exception", "")
        if level not in ("warning", "error", "critical") and not exception:
            continue
        record.pop("timestamp", None)
        text = f"{level} {record.pop('event', '')!r} " + " ".join(
            f"{k}={v}" for k, v in record.items()
        )
        if exception:
            text += " | " + exception.strip().splitlines()[-1]
        records.append(text[:400])
    if len(records) > limit:
        records = [*records[: limit // 2], "...", *records[-limit // 2 :]]
    return "\n".join(records) or "(none)"


def report(burst: Burst, outcomes: list[Outcome], problems: list[str], log: str) -> str:
    lines = ["The burst broke the service's contract:", *(f"  - {p}" for p in problems)]
    lines.append("Operations (start-end seconds from the burst's start: how each ended):")
    for i, (op, outcome) in enumerate(zip(burst.operations, outcomes, strict=True)):
        lines.append(
            f"  {i}: {op!r}\n      {outcome.start:.2f}-{outcome.end:.2f}: {outcome.summary()}"
        )
    lines.append("Warnings and errors the stack logged meanwhile:")
    lines.append(log_excerpt(log))
    return "\n".join(lines)


# Bursts that broke the service once, run first in every profile: ids the
# scheduler also gave sequences ("<id>/<i>" for n > 1, "<id>/beam<k>" for
# beam search) used while their owner runs, either way round; ids over the
# 256-byte limit; and forks of n > 1 and beam search under pool pressure
# (a step whose copy-on-write copies reused a block as both source and
# destination; it does not break every run).
REGRESSIONS = (
    Burst(
        (
            Generate("col", length=40, max_tokens=40, n=2, ignore_eos=True),
            Generate("col/1", length=40, ignore_eos=True, after=0),
        )
    ),
    Burst(
        (
            Generate("x/1", length=40, max_tokens=40, ignore_eos=True),
            Generate("x", length=40, n=2, ignore_eos=True, after=0),
        )
    ),
    Burst(
        (
            Generate("bm", length=40, max_tokens=24, beam_width=2, ignore_eos=True),
            Generate("bm/beam1", length=40, ignore_eos=True, delay_s=0.1),
            Generate("bm/beam2", length=40, ignore_eos=True, delay_s=0.3),
        )
    ),
    Burst(
        (
            Generate("bm/beam1", length=40, max_tokens=40, ignore_eos=True),
            Generate("bm", length=40, beam_width=2, ignore_eos=True, after=0),
        )
    ),
    Burst(
        (
            Generate(sized_id(256, "🙂"), n=2),
            Generate(sized_id(257, "a")),
            Generate(sized_id(300, "é"), n=3, after=0),
            Abort(sized_id(257, "a")),
        )
    ),
    Burst(
        (
            Generate("a", length=48, max_tokens=12, n=4),
            Generate("b", length=16, max_tokens=10, n=4, after=0),
            Generate("c", text=2, length=35, max_tokens=21, beam_width=2, ignore_eos=True),
            Generate("d", length=9, max_tokens=31, n=3, ignore_eos=True, delay_s=0.02),
        )
    ),
)


@pytest.mark.timeout(600 + 20 * MAX_EXAMPLES)
@PROFILE
@given(burst=bursts(MAX_OPERATIONS))
@example(burst=REGRESSIONS[0])
@example(burst=REGRESSIONS[1])
@example(burst=REGRESSIONS[2])
@example(burst=REGRESSIONS[3])
@example(burst=REGRESSIONS[4])
@example(burst=REGRESSIONS[5])
def test_concurrent_operations_keep_the_service_sound(fuzz_stack: Stack, burst: Burst) -> None:
    process = fuzz_stack.ready()
    log_start = len(process.stderr())
    outcomes = asyncio.run(run_burst(process.target, burst))
    problems = []
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome.operation, Generate):
            found = check_status(outcome, outcomes) + check_stream(outcome, outcomes)
        elif isinstance(outcome.operation, Abort):
            found = check_abort(outcome, outcomes)
        else:
            found = check_stats(outcome)
        problems += [f"operation {i}: {p}" for p in found]
    problems += check_greedy_agreement(outcomes)
    problems += [f"after the burst: {p}" for p in still_answers(process) + settle(process)]
    if process.process.poll() is not None:
        problems.append(f"the stack exited with {process.process.returncode}")
    assert not problems, report(burst, outcomes, problems, process.stderr()[log_start:])
