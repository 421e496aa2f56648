"""A Generate call made into a generation, and the executor it goes to:
the router's hint when it can be honoured, else the longest cached prefix,
then the most free blocks."""

from __future__ import annotations

import pytest

from pagedkv.bench.scheduler.executor_sim import sampled_rows, step_response
from pagedkv.common.errors import InvalidArgument, ResourceExhausted
from pagedkv.scheduler.executor_scheduler import ExecutorScheduler
from pagedkv.scheduler.placement import new_generation, place
from pagedkv.scheduler.sequence import Generation
from pagedkv.v1 import common_pb2, scheduler_pb2
from tests.scheduler.stepping import live_scheduler, run_to_end

Hint = scheduler_pb2.PlacementHint
PROMPT = list(range(3, 51))  # 48 tokens: three full blocks of 16


def call(n: int = 1, max_tokens: int = 4, **fields: object) -> scheduler_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, n=n, max_tokens=max_tokens)
    return scheduler_pb2.GenerateRequest(sampling=sampling, **fields)  # type: ignore[arg-type]


def two_executors(small: int = 32, large: int = 64) -> dict[str, ExecutorScheduler]:
    return {"small": live_scheduler(small), "large": live_scheduler(large)}


def generation_on(
    schedulers: dict[str, ExecutorScheduler], request_id: str = "g", n: int = 1
) -> Generation:
    info = next(iter(schedulers.values())).info
    return new_generation(request_id, PROMPT, call(n), info, None, schedulers, key=1)


def test_a_generation_has_n_sequences_over_the_prompt_and_changes_no_scheduler() -> None:
    schedulers = two_executors()
    generation = generation_on(schedulers, n=3)
    assert [s.index for s in generation.sequences] == [0, 1, 2]
    assert all(list(s.request.token_ids) == PROMPT for s in generation.sequences)
    assert all(s.request.num_prompt_tokens == len(PROMPT) for s in generation.sequences)
    assert generation.max_tokens == 4 and generation.eos_token_ids == frozenset({2})
    for scheduler in schedulers.values():
        assert not scheduler.waiting and not scheduler.running
        assert scheduler.kv.pool.get_num_free_blocks() == scheduler.info.num_blocks - 1


def test_a_prompt_no_pool_could_hold_is_refused_naming_the_prompt() -> None:
    schedulers = two_executors(small=3, large=4)  # 3 usable blocks at most
    info = schedulers["small"].info
    with pytest.raises(ResourceExhausted, match="prompt: 48 tokens need 5 blocks"):
        new_generation("g", PROMPT, call(), info, None, schedulers, key=1)
    with pytest.raises(InvalidArgument, match="n"):
        new_generation("g", PROMPT, call(n=100), info, None, schedulers, key=1)


def test_without_a_hint_the_most_free_blocks_win_then_the_cached_prefix_does() -> None:
    schedulers = two_executors()
    assert place(schedulers, generation_on(schedulers), "") == ("large", Hint.PLACEMENT_HINT_NONE)
    # The prompt runs on the small executor: its three full blocks stay cached there.
    small = schedulers["small"]
    first = generation_on({"small": small}, "first")
    small.add(first.sequences[0])
    run_to_end(small, [first], lambda m: step_response(m, [7] * len(sampled_rows(m))), 1)
    assert place(schedulers, generation_on(schedulers), "") == ("small", Hint.PLACEMENT_HINT_NONE)


def test_a_hint_is_honoured_unless_its_executor_drains_or_is_not_held() -> None:
    schedulers = two_executors()
    generation = generation_on(schedulers)
    assert place(schedulers, generation, "small") == ("small", Hint.PLACEMENT_HINT_HONOURED)
    assert place(schedulers, generation, "gone:1") == ("large", Hint.PLACEMENT_HINT_NOT_HELD)
    schedulers["large"].draining = True
    assert place(schedulers, generation, "large") == ("small", Hint.PLACEMENT_HINT_DRAINING)
    schedulers["small"].draining = True  # all draining: still the best of them
    assert place(schedulers, generation, "") == ("large", Hint.PLACEMENT_HINT_NONE)
