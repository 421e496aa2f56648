"""Launched steps (``Executor.launch`` / ``complete``), in process on the CPU.

A stream launches step N + 1 before step N completes (step_pipeline.py). The
order of effects must stay the order of the messages: a later step continues
from an earlier one's sample, an untag in a later step removes a tag that an
earlier step sets, and every response carries its own step's samples.

Decode windows (``num_decode_steps``): one message runs N decode steps, each
continuing from the previous one's samples on the device, and gives the
tokens N single steps give.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.common.errors import InvalidArgument
from pagedkv.executor.engine import Executor
from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.runner_config import RunnerConfig
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


# -- decode windows (num_decode_steps) ----------------------------------------


def window(owner: common_pb2.Owner, seqs: list[Seq], num_steps: int) -> executor_pb2.StepRequest:
    """A decode window of ``num_steps`` over ``seqs`` (their tables resent whole)."""
    request = decode(owner, seqs)
    request.num_decode_steps = num_steps
    for seq in seqs:
        seq.num_computed += num_steps - 1
    return request


def take_window(seqs: list[Seq], response: executor_pb2.StepResponse, num_steps: int) -> None:
    assert list(response.sampled_rows) == [s.row for s in seqs] * num_steps
    tokens = list(response.sampled_token_ids)
    for j in range(num_steps):
        for i, seq in enumerate(seqs):
            seq.output.append(tokens[j * len(seqs) + i])


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_decode_window_gives_the_tokens_of_its_steps_run_one_by_one(
    executor: Executor, sampling: str
) -> None:
    params = (
        common_pb2.SamplingParams(temperature=0.0)
        if sampling == "greedy"
        else common_pb2.SamplingParams(temperature=1.0, seed=7)
    )
    one_by_one = window_tokens(executor, params, [1] * 12)
    assert window_tokens(executor, params, [4, 1, 3, 4]) == one_by_one
    assert window_tokens(executor, params, [12]) == one_by_one


def window_tokens(
    executor: Executor, params: common_pb2.SamplingParams, windows: list[int]
) -> list[list[int]]:
    """Two prompts prefilled, then decoded in windows of the given sizes (1:
    a single step): each sequence's tokens."""
    prompts = [[5, 9, 2, 7, 11, 3], [4, 4, 8, 1]]
    fresh(executor)
    seqs = [Seq(row=r, blocks=[1 + 2 * r, 2 + 2 * r], num_computed=0) for r in range(2)]
    for seq, prompt in zip(seqs, prompts, strict=True):
        take_samples([seq], executor.step(prefill(OWNER, seq, f"r{seq.row}", prompt, params)))
    for num_steps in windows:
        if num_steps == 1:
            take_samples(seqs, executor.step(decode(OWNER, seqs)))
        else:
            take_window(seqs, executor.step(window(OWNER, seqs, num_steps)), num_steps)
    return [seq.output for seq in seqs]


def test_a_decode_window_with_a_new_request_or_too_few_blocks_is_refused(
    executor: Executor,
) -> None:
    fresh(executor)
    seq = Seq(row=0, blocks=[1], num_computed=0)
    executor.step(prefill(OWNER, seq, "r", [1, 2, 3]))
    other = Seq(row=1, blocks=[2], num_computed=0)
    mixed = prefill(OWNER, other, "s", [4, 5])
    mixed.num_decode_steps = 2
    with pytest.raises(InvalidArgument, match=r"^num_decode_steps"):
        executor.step(mixed)
    # The row holds one block of BLOCK_SIZE tokens: a window past it is refused.
    too_long = window(OWNER, [seq], BLOCK_SIZE)
    with pytest.raises(InvalidArgument, match=r"^new_block_counts"):
        executor.step(too_long)
    assert executor.runner.rows.num_tokens[0] == 3  # nothing changed
