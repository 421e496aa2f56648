"""The step contract (``pagedkv.common.step_contract``) as both sides of the
wire read it: a decode window the scheduler's encoder writes is one the
executor's decoder accepts up to ``MAX_DECODE_STEPS``, and refused, naming
the field, one step past it; the scheduler CLI's defaults are the contract's."""

from __future__ import annotations

import argparse
from array import array

import numpy as np
import pytest
import torch

from pagedkv.common.cli import build_parser
from pagedkv.common.errors import InvalidArgument
from pagedkv.common.ids import BlockId
from pagedkv.common.step_contract import (
    DEFAULT_DECODE_WINDOW,
    DEFAULT_PIPELINE_DEPTH,
    MAX_DECODE_STEPS,
    ONE_STEP,
    SINGLE_STEP_PIPELINE_DEPTH,
    default_pipeline_depth,
)
from pagedkv.executor.rows import Rows
from pagedkv.executor.step_plan import plan_message
from pagedkv.executor.step_types import Limits
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.server import config_from_args
from pagedkv.scheduler.step_message import NewRequestPlan, StepPlan, encode_step
from pagedkv.v1 import common_pb2

OWNER = common_pb2.Owner(owner_id="test", epoch=1)
BLOCK_SIZE = 16
PROMPT = [5, 9, 2]
# Enough blocks for the prompt and a window one step past the limit.
NUM_ROW_BLOCKS = -(-(len(PROMPT) + MAX_DECODE_STEPS + 1) // BLOCK_SIZE)
LIMITS = Limits(
    num_blocks=64,
    block_size=BLOCK_SIZE,
    vocab_size=100,
    max_model_len=256,
    max_num_batched_tokens=512,
    max_logprobs=5,
    group_windowed=(False,),
)


def _plan() -> StepPlan:
    return StepPlan.start(first_step_id=1, copies=[], events=[], freed_rows=[])


def _prefilled_rows() -> Rows:
    """Executor rows where row 0 holds PROMPT, prefilled by a message the
    scheduler's encoder wrote, its sample pending."""
    rows = Rows(1, 4, LIMITS.max_model_len // BLOCK_SIZE, LIMITS.max_model_len, torch.device("cpu"))
    prefill = _plan()
    prefill.new_requests.append(
        NewRequestPlan("r", 0, array("I", PROMPT), common_pb2.SamplingParams(), len(PROMPT))
    )
    prefill.num_scheduled_tokens.append(len(PROMPT))
    prefill.num_computed_tokens.append(0)
    prefill.continue_from_sampled.append(False)
    prefill.needs_sample.append(True)
    prefill.block_table_starts.append(0)
    prefill.new_block_counts.append(NUM_ROW_BLOCKS)
    prefill.new_block_ids.extend(BlockId(b) for b in range(1, 1 + NUM_ROW_BLOCKS))
    _, message = encode_step(OWNER, prefill)
    rows.apply(plan_message(message, rows, LIMITS))
    rows.record_samples(np.array([0]), torch.tensor([0]), torch.tensor([7]))
    return rows


def _window(num_steps: int) -> StepPlan:
    """Row 0's next decode, as a window of ``num_steps`` steps."""
    window = _plan()
    window.rows.append(0)
    window.num_scheduled_tokens.append(1)
    window.num_computed_tokens.append(len(PROMPT))
    window.continue_from_sampled.append(True)
    window.needs_sample.append(True)
    window.block_table_starts.append(NUM_ROW_BLOCKS)
    window.new_block_counts.append(0)
    window.num_decode_steps = num_steps
    return window


@pytest.mark.parametrize("num_steps", [ONE_STEP, 2, MAX_DECODE_STEPS])
def test_windows_the_encoder_writes_up_to_the_limit_are_accepted(num_steps: int) -> None:
    rows = _prefilled_rows()
    _, message = encode_step(OWNER, _window(num_steps))
    assert message.num_decode_steps == (0 if num_steps == ONE_STEP else num_steps)
    plan = plan_message(message, rows, LIMITS)
    assert plan.num_steps == num_steps
    assert plan.history_lengths.tolist() == [len(PROMPT) + num_steps]


def test_a_window_one_step_past_the_limit_is_refused_naming_the_field() -> None:
    rows = _prefilled_rows()
    _, message = encode_step(OWNER, _window(MAX_DECODE_STEPS + 1))
    with pytest.raises(
        InvalidArgument, match=rf"^num_decode_steps: {MAX_DECODE_STEPS + 1} > {MAX_DECODE_STEPS}$"
    ):
        plan_message(message, rows, LIMITS)


def _scheduler_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["scheduler", "--executor", "127.0.0.1:1", *argv])


def test_the_cli_defaults_are_the_contracts() -> None:
    config = config_from_args(_scheduler_args(), ["127.0.0.1:1"])
    assert config.decode_window == DEFAULT_DECODE_WINDOW
    assert config.pipeline_depth == DEFAULT_PIPELINE_DEPTH
    # Single steps get more steps in flight, unless asked for fewer.
    single = config_from_args(_scheduler_args("--decode-window", "1"), ["127.0.0.1:1"])
    assert single.pipeline_depth == SINGLE_STEP_PIPELINE_DEPTH == default_pipeline_depth(1)
    asked = _scheduler_args("--decode-window", "1", "--pipeline-depth", "2")
    assert config_from_args(asked, ["127.0.0.1:1"]).pipeline_depth == 2
    # Code that builds a scheduler itself gets one step per message.
    assert SchedulerConfig(executors=()).decode_window == ONE_STEP
    assert SchedulerConfig(executors=()).pipeline_depth == DEFAULT_PIPELINE_DEPTH


def test_the_cli_refuses_a_decode_window_past_the_executors_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _scheduler_args("--decode-window", str(MAX_DECODE_STEPS)).decode_window == (
        MAX_DECODE_STEPS
    )
    with pytest.raises(SystemExit):
        _scheduler_args("--decode-window", str(MAX_DECODE_STEPS + 1))
    assert f"{MAX_DECODE_STEPS + 1} is not in {ONE_STEP}..{MAX_DECODE_STEPS}" in (
        capsys.readouterr().err
    )
