"""Launched steps (``Executor.launch`` / ``complete``), in process on the CPU.

A stream launches step N + 1 before step N completes (step_pipeline.py). The
order of effects must stay the order of the messages: a later step continues
from an earlier one's sample, an untag in a later step removes a tag that an
earlier step sets, and every response carries its own step's samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.executor.engine import Executor
from pagedkv.executor.model_runner import ModelRunner, RunnerConfig
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import common_pb2, executor_pb2
from tests.executor.test_block_tags import h, tagging
from tests.executor.test_executor_api import BLOCK_SIZE, Seq, decode, prefill, take_samples

OWNER = common_pb2.Owner(owner_id="test", epoch=1)


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executor]:
    model_dir: Path = tmp_path_factory.mktemp("llama")
    make_tiny_model(model_dir, "llama", seed=3)
    config = RunnerConfig(
        model=str(model_dir), kernel_backend="torch", num_blocks=64, max_num_rows=4
    )
    runner = ModelRunner(config)
    runner.warm_up()
    executor = Executor(runner, "tiny")
    yield executor


def fresh(executor: Executor) -> None:
    executor.reset(executor_pb2.ResetRequest(owner=OWNER, drop_cached_blocks=True))


def tags_of(executor: Executor) -> list[tuple[int, bytes, int]]:
    listing = executor.list_cached_blocks(executor_pb2.ListCachedBlocksRequest(owner=OWNER))
    return [
        (b, x, g)
        for chunk in listing
        for b, x, g in zip(chunk.block_ids, chunk.block_hashes, chunk.group_ids, strict=True)
    ]


def test_steps_launched_ahead_give_the_tokens_of_steps_run_in_turn(executor: Executor) -> None:
    prompt = [5, 9, 2, 7, 11, 3]

    def generate(ahead: bool) -> list[int]:
        fresh(executor)
        seq = Seq(row=1, blocks=[1, 2], num_computed=0)
        requests = [prefill(OWNER, seq, "r", prompt)]
        requests += [decode(OWNER, [seq]) for _ in range(2 * BLOCK_SIZE - len(prompt) - 1)]
        if not ahead:
            for request in requests:
                take_samples([seq], executor.step(request))
            return seq.output
        launched = [executor.launch(requests[0])]
        for request in requests[1:]:
            launched.append(executor.launch(request))  # before the previous completes
            take_samples([seq], executor.complete(launched.pop(0)))
        take_samples([seq], executor.complete(launched.pop(0)))
        return seq.output

    in_turn = generate(ahead=False)
    assert generate(ahead=True) == in_turn
    assert len(in_turn) == 2 * BLOCK_SIZE - len(prompt)


def test_a_later_untag_wins_over_an_earlier_tag_not_yet_completed(executor: Executor) -> None:
    fresh(executor)
    first = executor.launch(tagging(OWNER, (5, h("a"), 0), (6, h("b"), 0)))
    second = executor.launch(tagging(OWNER, untag=(5,)))
    executor.complete(first)
    executor.complete(second)
    assert tags_of(executor) == [(6, h("b"), 0)]


def test_a_listing_between_launch_and_completion_holds_the_launched_tags(
    executor: Executor,
) -> None:
    fresh(executor)
    launched = executor.launch(tagging(OWNER, (7, h("c"), 0)))
    assert tags_of(executor) == [(7, h("c"), 0)]
    assert executor.get_info().num_tagged_blocks == 1
    executor.complete(launched)
    assert tags_of(executor) == [(7, h("c"), 0)]


def test_a_reset_that_drops_the_tags_drops_those_of_steps_not_yet_completed(
    executor: Executor,
) -> None:
    fresh(executor)
    launched = executor.launch(tagging(OWNER, (8, h("d"), 0)))
    executor.reset(executor_pb2.ResetRequest(owner=OWNER, drop_cached_blocks=True))
    executor.complete(launched)
    assert tags_of(executor) == []
