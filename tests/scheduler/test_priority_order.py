"""Request priority on one executor, as the proto promises: waiting requests
are admitted in (priority, arrival) order (lower value first), and when
blocks run out the running request with the highest priority value, the
newest among equals, is preempted first, whatever order they were admitted
in."""

from __future__ import annotations

import pytest

from pagedkv.bench.scheduler.executor_sim import sampled_rows, step_response
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.sequence import Generation
from pagedkv.v1 import executor_pb2
from tests.scheduler.stepping import add_generation, live_scheduler, run_to_end

BLOCK = 16  # tokens per block of the synthetic executor
SHORT = list(range(3, 3 + BLOCK - 1))  # one block, with room for one more token


def respond(message: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
    return step_response(message, [7] * len(sampled_rows(message)))


class Stepper:
    """A live scheduler whose generations are named, stepped one step at a
    time with nothing left in flight."""

    def __init__(self, num_blocks: int, max_num_rows: int) -> None:
        self.scheduler: ExecutorScheduler = live_scheduler(num_blocks, max_num_rows)
        self.generations: dict[str, Generation] = {}
        self._names: dict[str, str] = {}  # first sequence's id -> name

    def add(
        self,
        name: str,
        priority: int,
        arrival: float,
        prompt: list[int] = SHORT,
        max_tokens: int = 1,
    ) -> None:
        generation = add_generation(
            self.scheduler,
            name,
            prompt,
            max_tokens,
            key=len(self.generations) + 1,
            priority=priority,
            arrival=arrival,
        )
        self.generations[name] = generation
        self._names[generation.sequences[0].request.seq_id] = name

    def step(self) -> list[str]:
        """Sends one step and applies its answer; the names it admitted."""
        scheduled = self.scheduler.schedule()
        assert scheduled is not None
        assert not scheduled.before
        processed = self.scheduler.process(scheduled, respond(scheduled.request))
        assert not processed.errors, processed.errors
        for generation in processed.touched:
            generation.flush()
        return [self._names[r.seq_id] for r in scheduled.request.new_requests]

    @property
    def waiting(self) -> list[str]:
        return [self._names[s.request.seq_id] for s in self.scheduler.waiting]

    @property
    def preempted(self) -> set[str]:
        return {
            name for name, g in self.generations.items() if g.sequences[0].request.num_preemptions
        }


def test_waiting_requests_are_admitted_in_priority_then_arrival_order() -> None:
    # One row: each generation runs alone, so the admissions are the order.
    stepper = Stepper(num_blocks=8, max_num_rows=1)
    stepper.add("a", 1, 1.0)
    stepper.add("b", 0, 3.0)
    stepper.add("c", 0, 2.0)
    stepper.add("d", -1, 4.0)
    stepper.add("e", 1, 0.5)
    admitted = stepper.step()
    # A later arrival joins the queue at its place, not at its end.
    stepper.add("g", 0, 2.5)
    while not all(g.done for g in stepper.generations.values()):
        admitted += stepper.step()
    assert admitted == ["d", "c", "g", "b", "e", "a"]
    assert stepper.scheduler.kv.check_integrity().ok


def test_a_less_important_request_does_not_pass_one_waiting_for_blocks() -> None:
    # 4 usable blocks: "r" holds 2 (then 3), "big" needs 3, "small" needs 1.
    stepper = Stepper(num_blocks=5, max_num_rows=4)
    stepper.add("r", 0, 0.0, prompt=list(range(3, 3 + 2 * BLOCK)), max_tokens=2)
    stepper.add("big", 0, 1.0, prompt=list(range(103, 103 + 3 * BLOCK)))
    stepper.add("small", 1, 2.0, prompt=list(range(303, 303 + BLOCK)))
    assert [stepper.step() for _ in range(3)] == [["r"], [], ["big", "small"]]


@pytest.mark.parametrize(
    ("y", "z", "x", "victim"),
    [
        ((1, 1.0), (1, 2.0), (0, 3.0), "z"),  # the newest of the least important
        ((2, 1.0), (1, 2.0), (0, 3.0), "y"),  # the least important, though oldest
        ((0, 1.0), (0, 2.0), (0, 3.0), "x"),  # all equal: the newest
        ((0, 1.0), (0, 2.0), (-1, 3.0), "z"),  # a newer, more important one is kept
    ],
)
def test_the_least_important_newest_running_request_is_preempted_first(
    y: tuple[int, float], z: tuple[int, float], x: tuple[int, float], victim: str
) -> None:
    # 4 usable blocks. "y" and "z" are admitted first, "x" a step later, so
    # they were admitted in the order y, z, x whatever their priorities.
    # Each holds one block; in the third step y and z each need a second
    # one and one block is free.
    stepper = Stepper(num_blocks=5, max_num_rows=4)
    stepper.add("y", *y, max_tokens=8)
    stepper.add("z", *z, max_tokens=8)
    assert sorted(stepper.step()) == ["y", "z"]
    stepper.add("x", *x, max_tokens=8)
    assert stepper.step() == ["x"]
    assert not stepper.preempted
    stepper.step()
    assert stepper.preempted == {victim}
    assert stepper.waiting == [victim]
    assert stepper.scheduler.num_preemptions == 1
    generations = list(stepper.generations.values())
    run_to_end(stepper.scheduler, generations, respond, depth=1)
    assert all(len(g.sequences[0].request.token_ids) == len(SHORT) + 8 for g in generations)
    assert stepper.scheduler.kv.check_integrity().ok


def test_a_preempted_request_waits_at_its_place_ahead_of_later_arrivals() -> None:
    stepper = Stepper(num_blocks=5, max_num_rows=4)
    stepper.add("y", 1, 1.0, max_tokens=8)
    stepper.add("z", 1, 2.0, max_tokens=8)
    stepper.step()
    stepper.add("x", 0, 3.0, max_tokens=8)
    stepper.step()
    # Arrives after z, with z's priority, before z is preempted.
    stepper.add("w", 1, 4.0, max_tokens=8)
    stepper.step()
    assert stepper.preempted == {"z"}
    assert stepper.waiting == ["z", "w"]
