"""A scheduler that takes an executor over with its cache evicts the blocks
it adopts as the old owner would have: the executor lists its tags in the
order the old owner released them (a finished request's blocks from its
last to its first), so a churn that reuses some adopted blocks takes a
prefix's tail and leaves its head a hit. Real executor and scheduler
processes on the CPU."""

from __future__ import annotations

from pathlib import Path

from tests.executor.driver import ExecutorProcess
from tests.executor.test_generation import PROMPTS, model_dirs
from tests.service.stack import Process
from tests.service.test_stack import assert_nothing_held, collect, greedy_request

__all__ = ["model_dirs"]

NUM_BLOCKS = 12  # 11 usable blocks of 16 tokens


def test_an_adopted_prefix_loses_its_tail_before_its_head(model_dirs: dict[str, Path]) -> None:
    model = model_dirs["llama"]
    prompt = PROMPTS[2]  # 61 tokens; with 8 outputs, four full blocks are cached
    other = list(b"another request, forty tokens in length")  # two more full blocks
    churn = [(7 * i) % 250 + 1 for i in range(90)]  # 98 tokens: seven blocks
    with ExecutorProcess(model, num_blocks=NUM_BLOCKS) as executor:
        args = ["scheduler", "--executor", executor.target, "--port", "0", "--model", str(model)]
        with Process(args) as first:
            expected, _ = collect(first.stub, greedy_request(prompt, 8))
            collect(first.stub, greedy_request(other, 8))
            assert_nothing_held(first.stub)
        with Process(args) as second:  # takes the executor over, its cache kept
            assert assert_nothing_held(second.stub).executors[0].num_adopted_cached_blocks == 6
            # Five blocks hold nothing; the churn's other two are adopted: the
            # prompt's last two, released first (without the order, its first
            # two, and the prompt would hit nothing).
            collect(second.stub, greedy_request(churn, 8))
            tokens, chunks = collect(second.stub, greedy_request(prompt, 8))
            assert tokens[0] == expected[0]
            assert chunks[-1].usage.cached_prompt_tokens == 32
            assert_nothing_held(second.stub)
