"""The Executor gRPC API against a real ``pagedkv executor`` process: every bad
input refused with its field named and nothing changed, fencing, copy-on-write
forks, the step stream, health and reflection, and sampling (seeds, logprobs).

One llama executor serves the whole module (a mistral one serves the
sliding-window test); each test starts from a ``Reset`` with a fresh epoch.
"Nothing changed" is shown the strong way: after a refused call, a valid
continuation of the same requests still gives Hugging Face's greedy tokens.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pagedkv.executor.tiny_model import MISTRAL_SLIDING_WINDOW, VOCAB_SIZE, make_tiny_model
from pagedkv.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from tests.executor.driver import GREEDY, Driver, ExecutorProcess
from tests.executor.test_generation import hf_greedy

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXISTS = grpc.StatusCode.ALREADY_EXISTS
FENCED = grpc.StatusCode.FAILED_PRECONDITION

BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_NUM_ROWS = 8
MAX_NUM_BATCHED_TOKENS = 64
MAX_MODEL_LEN = 128  # 8 blocks per row
MAX_LOGPROBS = 5
LIMITS = (
    "--max-num-rows",
    str(MAX_NUM_ROWS),
    "--max-num-batched-tokens",
    str(MAX_NUM_BATCHED_TOKENS),
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-logprobs",
    str(MAX_LOGPROBS),
)

P_A = list(b"Hello, paged world!")  # 19 tokens
P_C = list(b"KV ok")  # 5
P_D = list(b"The quick brown fox jumps over the lazy dog")[:40]  # 40
Q_B = list(b"Paged attention, batched")  # 24

EPOCHS = itertools.count(1)  # every Reset of the module takes the next epoch


@dataclass(frozen=True)
class Served:
    """An executor process, its model, and what it said before any Reset."""

    process: ExecutorProcess
    model_dir: Path
    info_before_reset: executor_pb2.GetInfoResponse
    refused_before_reset: grpc.RpcError  # a Step

    @property
    def stub(self) -> executor_pb2_grpc.ExecutorStub:
        return self.process.stub


def _serve(model_dir: Path, *extra_args: str) -> Iterator[Served]:
    args = (*LIMITS, *extra_args)
    with ExecutorProcess(model_dir, num_blocks=NUM_BLOCKS, extra_args=args) as process:
        info = process.stub.GetInfo(executor_pb2.GetInfoRequest())
        owner = common_pb2.Owner(owner_id="early", epoch=1)
        error = refused(process.stub.Step, executor_pb2.StepRequest(owner=owner))
        yield Served(process, model_dir, info, error)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = tmp_path_factory.mktemp("api") / "llama"
    make_tiny_model(model_dir, "llama", seed=7)
    yield from _serve(model_dir, "--log-format", "json")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = tmp_path_factory.mktemp("api") / "mistral"
    make_tiny_model(model_dir, "mistral", seed=7)
    yield from _serve(model_dir)


# -- helpers ------------------------------------------------------------------


def take_over(stub: executor_pb2_grpc.ExecutorStub, owner_id: str = "test") -> common_pb2.Owner:
    """Resets the executor for ``owner_id`` with the module's next epoch."""
    owner = common_pb2.Owner(owner_id=owner_id, epoch=next(EPOCHS))
    stub.Reset(executor_pb2.ResetRequest(owner=owner))
    return owner


def refused(call: Callable[[Any], Any], request: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call(request)
    return error.value


def assert_status(error: grpc.RpcError, code: grpc.StatusCode, field_name: str) -> None:
    """The status is ``code`` and its message starts with the field at fault."""
    assert (error.code(), error.details()[: len(field_name)]) == (code, field_name), error.details()


def new_request(
    seq_id: str,
    row: int,
    prompt: list[int],
    sampling: common_pb2.SamplingParams = GREEDY,
) -> executor_pb2.NewRequest:
    return executor_pb2.NewRequest(
        seq_id=seq_id, row=row, prompt_token_ids=prompt, sampling=sampling
    )


def free_nothing(
    stub: executor_pb2_grpc.ExecutorStub, owner: common_pb2.Owner, **which: Any
) -> None:
    """Asserts that none of the rows or seq ids in ``which`` is live."""
    response = stub.Free(executor_pb2.FreeRequest(owner=owner, **which))
    assert list(response.freed_rows) == []


@dataclass
class Seq:
    """The test's view of one live row (one KV cache group)."""

    row: int
    blocks: list[int]
    num_computed: int  # as of the last request built for it
    output: list[int] = field(default_factory=list)


def prefill(
    owner: common_pb2.Owner,
    seq: Seq,
    seq_id: str,
    prompt: list[int],
    sampling: common_pb2.SamplingParams = GREEDY,
    step_id: int = 0,
) -> executor_pb2.StepRequest:
    """A step that sends ``seq`` as a new request and runs its whole prompt."""
    seq.num_computed = len(prompt)
    return executor_pb2.StepRequest(
        owner=owner,
        step_id=step_id,
        new_requests=[new_request(seq_id, seq.row, prompt, sampling)],
        num_scheduled_tokens=[len(prompt)],
        num_computed_tokens=[0],
        continue_from_sampled=[False],
        needs_sample=[True],
        block_table_starts=[0],
        new_block_counts=[len(seq.blocks)],
        new_block_ids=seq.blocks,
    )


def decode(
    owner: common_pb2.Owner,
    seqs: list[Seq],
    spare: Iterator[int] | None = None,
    step_id: int = 0,
) -> executor_pb2.StepRequest:
    """One decode step of ``seqs``, each continuing from its pending sample.

    Each row's table is resent whole (start 0), with a block from ``spare``
    when the token needs one. Advances ``num_computed`` as the step will.
    """
    request = executor_pb2.StepRequest(owner=owner, step_id=step_id)
    for seq in seqs:
        if seq.num_computed + 1 > len(seq.blocks) * BLOCK_SIZE:
            assert spare is not None
            seq.blocks.append(next(spare))
        request.rows.append(seq.row)
        request.num_scheduled_tokens.append(1)
        request.num_computed_tokens.append(seq.num_computed)
        request.continue_from_sampled.append(True)
        request.needs_sample.append(True)
        request.block_table_starts.append(0)
        request.new_block_counts.append(len(seq.blocks))
        request.new_block_ids.extend(seq.blocks)
        seq.num_computed += 1
    return request


def take_samples(seqs: list[Seq], response: executor_pb2.StepResponse) -> None:
    assert list(response.sampled_rows) == [s.row for s in seqs]
    for seq, token in zip(seqs, response.sampled_token_ids, strict=True):
        seq.output.append(token)


# -- every bad input is refused, naming its field, and changes nothing --------
#
# The scene, set by ``set_scene``: A (row 0, blocks 1 2) and C (row 2, block
# 4) have run their prompts and have a pending sample; D (row 3, block 5) has
# run the first 16 of its 40 prompt tokens. VALID_STEP frees C, sends B in
# C's row (reusing C's block 4), decodes A from its sample and runs the rest
# of D. The cases each break one thing in it; VALID_ALLOCATE and VALID_COPY
# would break A if they were applied at all.

B = new_request("B", 2, Q_B)
VALID_STEP: dict[str, Any] = dict(
    step_id=2,
    freed_rows=[2],
    new_requests=[B],
    rows=[0, 3],
    num_scheduled_tokens=[24, 1, 24],
    num_computed_tokens=[0, 19, 16],
    continue_from_sampled=[False, True, False],
    needs_sample=[True, True, True],
    block_table_starts=[0, 2, 1],
    new_block_counts=[2, 0, 2],
    new_block_ids=[4, 8, 6, 7],
    copy_src_block_ids=[10],
    copy_dst_block_ids=[11],
)
VALID_ALLOCATE: dict[str, Any] = dict(  # registers E and swaps A's block 2 for 13
    new_requests=[new_request("E", 4, [1, 2, 3])],
    rows=[0],
    block_table_starts=[0, 1],
    new_block_counts=[1, 1],
    new_block_ids=[9, 13],
)
VALID_COPY: dict[str, Any] = dict(src_block_ids=[5], dst_block_ids=[2])  # D's KV over A's


def set_scene(stub: executor_pb2_grpc.ExecutorStub, owner: common_pb2.Owner) -> list[int]:
    """Runs the scene's first step; returns A's first token."""
    response = stub.Step(
        executor_pb2.StepRequest(
            owner=owner,
            step_id=1,
            new_requests=[
                new_request("A", 0, P_A),
                new_request("C", 2, P_C),
                new_request("D", 3, P_D),
            ],
            num_scheduled_tokens=[19, 5, 16],
            num_computed_tokens=[0, 0, 0],
            continue_from_sampled=[False, False, False],
            needs_sample=[True, True, False],
            block_table_starts=[0, 0, 0],
            new_block_counts=[2, 1, 1],
            new_block_ids=[1, 2, 4, 5],
        )
    )
    assert list(response.sampled_rows) == [0, 2]
    return [response.sampled_token_ids[0]]


def assert_scene_goes_on(served: Served, owner: common_pb2.Owner, a_first: list[int]) -> None:
    """Nothing of a refused call is live, and the scene's valid step and three
    decodes give A, B and D their Hugging Face greedy tokens."""
    stub = served.stub
    free_nothing(stub, owner, rows=[1, 4, 5, 6, 7], seq_ids=["B", "E"])
    b, a, d = Seq(2, [4, 8], 24), Seq(0, [1, 2], 20, list(a_first)), Seq(3, [5, 6, 7], 40)
    take_samples([b, a, d], stub.Step(executor_pb2.StepRequest(owner=owner, **VALID_STEP)))
    for _ in range(3):
        take_samples([b, a, d], stub.Step(decode(owner, [b, a, d])))
    assert a.output == hf_greedy(served.model_dir, P_A, 5)
    assert b.output == hf_greedy(served.model_dir, Q_B, 4)
    assert d.output == hf_greedy(served.model_dir, P_D, 4)


def bad(call: str, field_name: str, code: grpc.StatusCode = INVALID, **changes: Any) -> Any:
    """A case: ``call``'s valid message with ``changes``, refused with ``code``
    naming ``field_name``."""
    return pytest.param(call, changes, code, field_name, id=f"{call}-{field_name.rstrip(':')}")


def b_with(
    prompt: Sequence[int] = Q_B, row: int = 2, seq_id: str = "B", **sampling: Any
) -> list[executor_pb2.NewRequest]:
    """VALID_STEP's new requests, with another B."""
    return [new_request(seq_id, row, list(prompt), common_pb2.SamplingParams(**sampling))]


def e_with(
    prompt: Sequence[int] = (1,), row: int = 4, seq_id: str = "E", **sampling: Any
) -> list[executor_pb2.NewRequest]:
    """VALID_ALLOCATE's new requests, with another E."""
    return [new_request(seq_id, row, list(prompt), common_pb2.SamplingParams(**sampling))]


BAD_INPUTS = [
    # block ids
    bad("Step", "new_block_ids[1]", new_block_ids=[4, NUM_BLOCKS, 6, 7]),
    bad("Step", "new_block_ids[2]", new_block_ids=[4, 8, 0, 7]),  # null, full attention
    bad("Allocate", "new_block_ids[1]", new_block_ids=[9, NUM_BLOCKS]),
    bad("Allocate", "new_block_ids[0]", new_block_ids=[0, 13]),
    # token ids
    bad("Step", "new_requests[0].prompt_token_ids[3]", new_requests=b_with([1, 2, 3, VOCAB_SIZE])),
    bad("Allocate", "new_requests[0].prompt_token_ids[1]", new_requests=e_with([1, VOCAB_SIZE])),
    bad("Step", "token_ids[0]", continue_from_sampled=[False] * 3, token_ids=[VOCAB_SIZE]),
    bad("Step", "new_requests[0].prompt_token_ids:", new_requests=b_with([65] * 129)),
    # positions that do not follow the row's history
    bad("Step", "num_computed_tokens[1]", num_computed_tokens=[0, 21, 16]),
    bad("Step", "num_computed_tokens[0]", num_computed_tokens=[25, 19, 16]),
    # rows and seq ids
    bad("Step", "rows[1]", rows=[0, 5]),
    bad("Step", "rows[1]", rows=[0, MAX_NUM_ROWS]),
    bad("Step", "rows[0]", rows=[2, 3]),  # freed by this step
    bad("Step", "rows:", rows=[0, 0]),
    bad("Allocate", "rows[0]", rows=[5]),
    bad("Step", "freed_rows[1]", freed_rows=[2, 5]),
    bad("Step", "freed_rows:", freed_rows=[2, 2]),
    bad("Step", "new_requests[0].row", new_requests=b_with(row=0)),
    bad("Step", "new_requests[0].row", freed_rows=[]),  # C still holds row 2
    bad("Step", "new_requests[0].row", new_requests=b_with(row=MAX_NUM_ROWS)),
    bad("Allocate", "new_requests[0].row", new_requests=e_with(row=3)),
    bad("Step", "new_requests[0].seq_id", EXISTS, new_requests=b_with(seq_id="A")),
    bad("Allocate", "new_requests[0].seq_id", EXISTS, new_requests=e_with(seq_id="D")),
    bad("Step", "new_requests[0].seq_id", new_requests=b_with(seq_id="")),
    # column lengths
    bad("Step", "num_scheduled_tokens:", num_scheduled_tokens=[24, 1]),
    bad("Step", "num_computed_tokens:", num_computed_tokens=[0, 19, 16, 0]),
    bad("Step", "continue_from_sampled:", continue_from_sampled=[False, True]),
    bad("Step", "needs_sample:", needs_sample=[True] * 4),
    bad("Step", "block_table_starts:", block_table_starts=[0, 2]),
    bad("Step", "new_block_counts:", new_block_counts=[2, 0, 2, 0]),
    bad("Step", "new_block_ids:", new_block_ids=[4, 8, 6, 7, 9]),
    bad("Step", "token_ids:", token_ids=[65]),
    bad("Allocate", "new_block_counts:", new_block_counts=[1, 1, 0]),
    # block tables
    bad("Step", "block_table_starts[1]", block_table_starts=[0, 3, 1]),
    bad("Step", "block_table_starts[0]", block_table_starts=[1, 2, 1]),  # new: must be 0
    bad("Allocate", "block_table_starts[1]", block_table_starts=[0, 3]),
    bad("Step", "new_block_counts[1]", block_table_starts=[0, 1, 1]),  # 16 < 20 tokens
    bad("Step", "new_block_counts[0]", new_block_counts=[1, 0, 2], new_block_ids=[4, 6, 7]),
    bad(
        "Step",
        "new_block_counts[1]",
        new_block_counts=[2, 7, 2],
        new_block_ids=[4, 8, *range(20, 27), 6, 7],
    ),
    # copies
    bad("Step", "copy_src_block_ids[1]", copy_src_block_ids=[10, 0], copy_dst_block_ids=[11, 12]),
    bad("Step", "copy_dst_block_ids[1]", copy_src_block_ids=[10, 12], copy_dst_block_ids=[11, 0]),
    bad(
        "Step",
        "copy_dst_block_ids[1]",
        copy_src_block_ids=[10, 12],
        copy_dst_block_ids=[11, NUM_BLOCKS],
    ),
    bad("Step", "copy_dst_block_ids:", copy_src_block_ids=[10, 12], copy_dst_block_ids=[11, 11]),
    bad("Step", "copy_dst_block_ids:", copy_src_block_ids=[10, 11], copy_dst_block_ids=[11, 12]),
    bad("Step", "copy_dst_block_ids:", copy_src_block_ids=[10, 12]),
    bad("CopyBlocks", "src_block_ids[1]", src_block_ids=[5, 0], dst_block_ids=[2, 12]),
    bad("CopyBlocks", "dst_block_ids[1]", src_block_ids=[5, 6], dst_block_ids=[2, 0]),
    bad("CopyBlocks", "dst_block_ids[1]", src_block_ids=[5, 6], dst_block_ids=[2, NUM_BLOCKS]),
    bad("CopyBlocks", "dst_block_ids:", src_block_ids=[5, 6], dst_block_ids=[2, 2]),
    bad("CopyBlocks", "dst_block_ids:", src_block_ids=[5, 2], dst_block_ids=[2, 12]),
    bad("CopyBlocks", "dst_block_ids:", src_block_ids=[5, 6]),
    # samples and token counts
    bad("Step", "continue_from_sampled[2]", continue_from_sampled=[False, True, True]),  # D
    bad("Step", "continue_from_sampled[0]", continue_from_sampled=[True, True, False]),  # new B
    bad("Step", "needs_sample[2]", num_scheduled_tokens=[24, 1, 0]),
    bad(
        "Step",
        "num_scheduled_tokens:",
        num_scheduled_tokens=[24, 1, 40],
        num_computed_tokens=[0, 19, 0],
    ),  # 65 tokens > max_num_batched_tokens
    bad("Step", "num_scheduled_tokens[1]", num_scheduled_tokens=[24, 110, 24]),  # > max_model_len
    # sampling params
    bad("Step", "new_requests[0].sampling.temperature", new_requests=b_with(temperature=-0.5)),
    bad("Step", "new_requests[0].sampling.temperature", new_requests=b_with(temperature=math.nan)),
    bad("Step", "new_requests[0].sampling.top_p", new_requests=b_with(top_p=0.0)),
    bad("Step", "new_requests[0].sampling.top_p", new_requests=b_with(top_p=1.5)),
    bad(
        "Step", "new_requests[0].sampling.logprobs", new_requests=b_with(logprobs=MAX_LOGPROBS + 1)
    ),
    bad("Allocate", "new_requests[0].sampling.top_p", new_requests=e_with(top_p=2.0)),
    bad(
        "Step",
        "new_requests[0].sampling.stop_token_ids",
        new_requests=b_with(min_tokens=2, stop_token_ids=[VOCAB_SIZE]),
    ),
    bad(
        "Step",
        "new_requests[0].num_prompt_tokens",
        new_requests=[
            executor_pb2.NewRequest(
                seq_id="B", row=2, prompt_token_ids=Q_B, num_prompt_tokens=len(Q_B) + 1
            )
        ],
    ),
]
BASES = {"Step": VALID_STEP, "Allocate": VALID_ALLOCATE, "CopyBlocks": VALID_COPY}
REQUESTS = {
    "Step": executor_pb2.StepRequest,
    "Allocate": executor_pb2.AllocateRequest,
    "CopyBlocks": executor_pb2.CopyBlocksRequest,
}


@pytest.mark.parametrize(("call", "changes", "code", "field_name"), BAD_INPUTS)
def test_a_bad_input_is_refused_naming_its_field_and_changes_nothing(
    llama: Served, call: str, changes: dict[str, Any], code: grpc.StatusCode, field_name: str
) -> None:
    owner = take_over(llama.stub)
    a_first = set_scene(llama.stub, owner)
    request = REQUESTS[call](owner=owner, **{**BASES[call], **changes})
    assert_status(refused(getattr(llama.stub, call), request), code, field_name)
    assert_scene_goes_on(llama, owner, a_first)


@pytest.mark.parametrize(
    ("forge", "code", "field_name"),
    [
        (lambda o: common_pb2.Owner(), INVALID, "owner.owner_id"),
        (lambda o: common_pb2.Owner(owner_id=o.owner_id), INVALID, "owner.epoch"),
        (lambda o: common_pb2.Owner(owner_id="other", epoch=o.epoch), FENCED, "owner"),
        (lambda o: common_pb2.Owner(owner_id=o.owner_id, epoch=o.epoch - 1), FENCED, "owner"),
        (lambda o: common_pb2.Owner(owner_id=o.owner_id, epoch=o.epoch + 1), FENCED, "owner"),
    ],
    ids=["no-owner", "epoch-0", "other-owner", "lower-epoch", "higher-epoch-without-reset"],
)
def test_a_step_from_anyone_but_the_owner_is_refused_and_changes_nothing(
    llama: Served,
    forge: Callable[[common_pb2.Owner], common_pb2.Owner],
    code: grpc.StatusCode,
    field_name: str,
) -> None:
    owner = take_over(llama.stub)
    a_first = set_scene(llama.stub, owner)
    request = executor_pb2.StepRequest(owner=forge(owner), **VALID_STEP)
    assert_status(refused(llama.stub.Step, request), code, field_name)
    assert_scene_goes_on(llama, owner, a_first)


def test_the_null_block_stands_for_blocks_that_left_a_sliding_window(mistral: Served) -> None:
    """Once a row's first block is out of the window, the scheduler frees it,
    puts the null block in its place and gives it to another request."""
    stub = mistral.stub
    (group,) = stub.GetInfo(executor_pb2.GetInfoRequest()).kv_cache_groups
    assert group.sliding_window == MISTRAL_SLIDING_WINDOW
    # From position 40 on, queries see no key of the first block (0..15).
    assert len(P_D) - (BLOCK_SIZE - 1) >= MISTRAL_SLIDING_WINDOW
    owner = take_over(stub)
    w = Seq(0, [1, 2, 3], 0)
    take_samples([w], stub.Step(prefill(owner, w, "w", P_D)))
    w.blocks[0] = 0
    x = Seq(1, [1], 0)
    step = prefill(owner, x, "x", P_C)
    step.MergeFrom(decode(owner, [w]))
    take_samples([x, w], stub.Step(step))
    for _ in range(5):
        take_samples([x, w], stub.Step(decode(owner, [x, w])))
    assert w.output == hf_greedy(mistral.model_dir, P_D, 7)
    assert x.output == hf_greedy(mistral.model_dir, P_C, 6)
    # A new request may start with the null block too (a prefix-cache hit
    # past the window).
    stub.Allocate(
        executor_pb2.AllocateRequest(
            owner=owner,
            new_requests=[new_request("y", 2, P_D)],
            block_table_starts=[0],
            new_block_counts=[3],
            new_block_ids=[0, 9, 10],
        )
    )
    freed = stub.Free(executor_pb2.FreeRequest(owner=owner, seq_ids=["y"]))
    assert list(freed.freed_rows) == [2]


# -- fencing ------------------------------------------------------------------


def test_calls_before_the_first_reset_are_refused(llama: Served) -> None:
    assert_status(llama.refused_before_reset, FENCED, "owner")
    assert llama.info_before_reset.owner == common_pb2.Owner()
    assert len(llama.info_before_reset.incarnation_id) == 32


def test_reset_takes_over_only_with_a_higher_epoch(llama: Served) -> None:
    stub = llama.stub
    alpha = take_over(stub, "alpha")
    for owner, code, field_name in (
        (common_pb2.Owner(owner_id="beta", epoch=alpha.epoch - 1), FENCED, "owner.epoch"),
        (common_pb2.Owner(owner_id="beta", epoch=alpha.epoch), FENCED, "owner.epoch"),
        (common_pb2.Owner(owner_id="beta"), INVALID, "owner.epoch"),
        (common_pb2.Owner(epoch=alpha.epoch + 1), INVALID, "owner.owner_id"),
    ):
        assert_status(refused(stub.Reset, executor_pb2.ResetRequest(owner=owner)), code, field_name)
    info = stub.GetInfo(executor_pb2.GetInfoRequest())
    assert info.owner == alpha
    beta = common_pb2.Owner(owner_id="beta", epoch=next(EPOCHS))
    reset = stub.Reset(executor_pb2.ResetRequest(owner=beta))
    assert (reset.previous_owner, reset.incarnation_id) == (alpha, info.incarnation_id)
    assert stub.GetInfo(executor_pb2.GetInfoRequest()).owner == beta


def test_a_stale_owner_is_fenced_after_a_takeover_and_changes_nothing(llama: Served) -> None:
    stub = llama.stub
    alpha = take_over(stub, "alpha")
    stub.Step(prefill(alpha, Seq(0, [1, 2], 0), "old", P_A))
    beta = common_pb2.Owner(owner_id="beta", epoch=next(EPOCHS))
    assert stub.Reset(executor_pb2.ResetRequest(owner=beta)).previous_owner == alpha
    a, d = Seq(0, [3, 4], 0), Seq(1, [5, 6, 7], 0)
    take_samples([a], stub.Step(prefill(beta, a, "a", P_A)))
    take_samples([d], stub.Step(prefill(beta, d, "d", P_D)))
    gamma = common_pb2.Owner(owner_id="gamma", epoch=beta.epoch + 1)  # never reset
    for owner in (alpha, gamma):
        stale_seqs = [Seq(0, [3, 4], a.num_computed), Seq(1, [5, 6, 7], d.num_computed)]
        for call, request in (
            (stub.Step, decode(owner, stale_seqs)),
            (stub.Step, prefill(owner, Seq(2, [8], 0), "stale", P_C)),
            (
                stub.Allocate,
                executor_pb2.AllocateRequest(
                    owner=owner,
                    rows=[0],
                    block_table_starts=[1],
                    new_block_counts=[1],
                    new_block_ids=[9],
                ),
            ),
            (stub.Free, executor_pb2.FreeRequest(owner=owner, rows=[0, 1])),
            (
                stub.CopyBlocks,
                executor_pb2.CopyBlocksRequest(owner=owner, src_block_ids=[5], dst_block_ids=[4]),
            ),
        ):
            assert_status(refused(call, request), FENCED, "owner")
    assert_status(refused(stub.Reset, executor_pb2.ResetRequest(owner=alpha)), FENCED, "owner")
    for _ in range(3):
        take_samples([a, d], stub.Step(decode(beta, [a, d])))
    assert a.output == hf_greedy(llama.model_dir, P_A, 4)
    assert d.output == hf_greedy(llama.model_dir, P_D, 4)
    free_nothing(stub, beta, seq_ids=["stale"])
    freed = stub.Free(executor_pb2.FreeRequest(owner=beta, seq_ids=["a", "d"]))
    assert list(freed.freed_rows) == [0, 1]


def test_reset_by_the_same_owner_restarts_its_session(llama: Served) -> None:
    stub = llama.stub
    owner = take_over(stub)
    a = Seq(0, [1, 2], 0)
    take_samples([a], stub.Step(prefill(owner, a, "a", P_A)))
    stub.Step(prefill(owner, Seq(1, [3], 0), "b", P_C))
    incarnation_id = stub.GetInfo(executor_pb2.GetInfoRequest()).incarnation_id
    reset = stub.Reset(executor_pb2.ResetRequest(owner=owner))
    assert (reset.previous_owner, reset.incarnation_id) == (owner, incarnation_id)
    assert stub.GetInfo(executor_pb2.GetInfoRequest()).owner == owner
    free_nothing(stub, owner, rows=[0, 1], seq_ids=["a", "b"])
    # The rows and ids are free to take again; the session runs as before.
    again = Seq(0, [1, 2], 0)
    take_samples([again], stub.Step(prefill(owner, again, "a", P_A)))
    assert again.output == a.output == hf_greedy(llama.model_dir, P_A, 1)


def test_asked_for_json_logs_the_executor_writes_only_json_lines(llama: Served) -> None:
    # The llama executor runs with --log-format json: every stderr line is a
    # JSON object (no progress bar), ending with the one that says it serves.
    deadline = time.monotonic() + 30
    while "executor serving" not in llama.process.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    records = [json.loads(line) for line in llama.process.stderr().splitlines() if line.strip()]
    serving = [r for r in records if r["event"] == "executor serving"]
    assert serving and serving[0]["level"] == "info" and serving[0]["num_blocks"] == NUM_BLOCKS


def test_get_info_describes_the_executor_and_its_incarnation(llama: Served) -> None:
    owner = take_over(llama.stub)
    info = llama.stub.GetInfo(executor_pb2.GetInfoRequest())
    assert info.incarnation_id == llama.info_before_reset.incarnation_id
    assert info.owner == owner
    assert (
        info.vocab_size,
        info.block_size,
        info.num_blocks,
        info.max_num_rows,
        info.max_num_batched_tokens,
        info.max_model_len,
        info.max_logprobs,
        info.device,
        info.dtype,
    ) == (
        VOCAB_SIZE,
        BLOCK_SIZE,
        NUM_BLOCKS,
        MAX_NUM_ROWS,
        MAX_NUM_BATCHED_TOKENS,
        MAX_MODEL_LEN,
        MAX_LOGPROBS,
        "cpu",
        "float32",
    )
    (group,) = info.kv_cache_groups
    assert not group.HasField("sliding_window")
    assert list(group.layer_indices) == [0, 1]
    assert info.bytes_per_block == group.page_size_bytes * 2


# -- copy-on-write ------------------------------------------------------------


@pytest.mark.parametrize("copy_by", ["step", "CopyBlocks"])
@pytest.mark.parametrize("fork_token", ["same", "other"])
def test_a_forked_child_gets_a_private_copy_of_the_partial_block(
    llama: Served, copy_by: str, fork_token: str
) -> None:
    """The parent runs its prompt and 5 decodes (24 tokens of KV: block 1 full,
    block 2 half). The child, a new request with the parent's whole history
    (its last token the parent's pending sample, or another token), shares
    block 1 and gets a copy of block 2, and runs only its last token."""
    stub = llama.stub
    owner = take_over(stub)
    spare = iter(range(20, NUM_BLOCKS))
    parent = Seq(0, [1, 2], 0)
    take_samples([parent], stub.Step(prefill(owner, parent, "parent", P_A)))
    for _ in range(5):
        take_samples([parent], stub.Step(decode(owner, [parent])))
    assert parent.num_computed == 24
    *history, last = P_A + parent.output
    child_prompt = [*history, last if fork_token == "same" else (last + 1) % 256]
    private = next(spare)
    poison = executor_pb2.CopyBlocksRequest(owner=owner, src_block_ids=[1], dst_block_ids=[private])
    stub.CopyBlocks(poison)  # other KV in it, so that a missing copy would show
    child = Seq(1, [1, private], 24)
    fork = executor_pb2.StepRequest(
        owner=owner,
        new_requests=[new_request("child", child.row, child_prompt)],
        num_scheduled_tokens=[1],
        num_computed_tokens=[24],
        continue_from_sampled=[False],
        needs_sample=[True],
        block_table_starts=[0],
        new_block_counts=[2],
        new_block_ids=child.blocks,
    )
    if copy_by == "step":
        fork.copy_src_block_ids.append(2)
        fork.copy_dst_block_ids.append(private)
    else:
        stub.CopyBlocks(
            executor_pb2.CopyBlocksRequest(owner=owner, src_block_ids=[2], dst_block_ids=[private])
        )
    fork.MergeFrom(decode(owner, [parent]))
    child.num_computed = 25
    take_samples([child, parent], stub.Step(fork))
    for _ in range(10):  # across the block boundary at 32 tokens
        take_samples([child, parent], stub.Step(decode(owner, [child, parent], spare)))
    assert parent.output == hf_greedy(llama.model_dir, P_A, 17)
    assert child.output == hf_greedy(llama.model_dir, child_prompt, 11)
    if fork_token == "same":
        assert child.output == parent.output[6:]


# -- the step stream ----------------------------------------------------------


class Stream:
    """A StepStream whose requests are sent one by one, without waiting."""

    def __init__(self, stub: executor_pb2_grpc.ExecutorStub) -> None:
        self.requests: queue.Queue[executor_pb2.StepRequest | None] = queue.Queue()
        self.responses = stub.StepStream(iter(self.requests.get, None))

    def send(self, request: executor_pb2.StepRequest) -> None:
        self.requests.put(request)

    def receive(self) -> executor_pb2.StepResponse:
        return next(self.responses)

    def end(self) -> None:
        """Sends no more requests (the client's half-close)."""
        self.requests.put(None)

    def close(self) -> None:
        self.end()
        self.responses.cancel()


@pytest.fixture
def streams(llama: Served) -> Iterator[Callable[[], Stream]]:
    opened: list[Stream] = []

    def open_stream() -> Stream:
        opened.append(Stream(llama.stub))
        return opened[-1]

    yield open_stream
    for stream in opened:
        stream.close()


def test_the_stream_answers_each_step_in_order_even_when_sent_ahead(
    llama: Served, streams: Callable[[], Stream]
) -> None:
    """Every step is sent before any response is read: the decodes continue
    from samples of steps whose responses the client has not seen."""
    owner = take_over(llama.stub)
    stream = streams()
    a, b = Seq(0, [1, 2], 0), Seq(1, [3, 4], 0)
    plan = [([a], prefill(owner, a, "a", P_A, step_id=100))]
    second = prefill(owner, b, "b", Q_B, step_id=101)
    second.MergeFrom(decode(owner, [a]))
    plan.append(([b, a], second))
    plan += [([b, a], decode(owner, [b, a], step_id=102 + i)) for i in range(4)]
    for _, request in plan:
        stream.send(request)
    for seqs, request in plan:
        response = stream.receive()
        assert response.step_id == request.step_id
        take_samples(seqs, response)
    stream.end()
    assert list(stream.responses) == []  # the stream ends cleanly
    assert stream.responses.code() == grpc.StatusCode.OK
    # Rows outlive the stream: a unary step continues them.
    take_samples([b, a], llama.stub.Step(decode(owner, [b, a])))
    assert a.output == hf_greedy(llama.model_dir, P_A, 7)
    assert b.output == hf_greedy(llama.model_dir, Q_B, 6)


def test_a_refused_message_ends_the_stream_and_nothing_after_it_applies(
    llama: Served, streams: Callable[[], Stream]
) -> None:
    stub = llama.stub
    owner = take_over(stub)
    stream = streams()
    a = Seq(0, [1, 2], 0)
    stream.send(prefill(owner, a, "a", P_A, step_id=1))
    bad = decode(owner, [a], step_id=2)
    bad.new_block_ids[1] = NUM_BLOCKS
    stream.send(bad)
    stream.send(prefill(owner, Seq(5, [9], 0), "late", P_C, step_id=3))
    take_samples([a], stream.receive())
    with pytest.raises(grpc.RpcError) as error:
        stream.receive()
    assert_status(error.value, INVALID, "new_block_ids[1]")
    free_nothing(stub, owner, rows=[5], seq_ids=["late"])
    a.num_computed -= 1  # the refused decode did not run
    for _ in range(3):
        take_samples([a], stub.Step(decode(owner, [a])))
    assert a.output == hf_greedy(llama.model_dir, P_A, 4)


def test_a_reset_ends_the_open_stream(llama: Served, streams: Callable[[], Stream]) -> None:
    stub = llama.stub
    owner = take_over(stub)
    old = streams()
    old.send(prefill(owner, Seq(0, [1, 2], 0), "a", P_A))
    old.receive()
    stub.Reset(executor_pb2.ResetRequest(owner=owner))  # a restart: the owner is still valid
    b = Seq(1, [3, 4], 0)
    old.send(prefill(owner, b, "b", Q_B))
    with pytest.raises(grpc.RpcError) as error:
        old.receive()
    assert (error.value.code(), "reset" in error.value.details()) == (FENCED, True)
    free_nothing(stub, owner, rows=[0, 1], seq_ids=["a", "b"])
    new = streams()
    new.send(prefill(owner, b, "b", Q_B))
    take_samples([b], new.receive())
    assert b.output == hf_greedy(llama.model_dir, Q_B, 1)


# -- health and reflection ----------------------------------------------------


def test_health_reports_serving_and_reflection_lists_the_executor(llama: Served) -> None:
    channel = llama.process.channel
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagedkv.v1.Executor"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    database = ProtoReflectionDescriptorDatabase(channel)
    assert "pagedkv.v1.Executor" in set(database.get_services())
    service = DescriptorPool(database).FindServiceByName("pagedkv.v1.Executor")
    expected = executor_pb2.DESCRIPTOR.services_by_name["Executor"]
    assert {m.name for m in service.methods} == {m.name for m in expected.methods}


# -- undecodable requests -----------------------------------------------------

GARBAGE = b"\xff\xff\xff"  # no protobuf message: a field number whose varint never ends


def assert_undecodable(error: grpc.RpcError, message_name: str) -> None:
    details = f"the request is not a valid {message_name} message"
    assert (error.code(), error.details()) == (INVALID, details)


def test_an_undecodable_request_is_invalid_argument_and_changes_nothing(llama: Served) -> None:
    stub, channel = llama.stub, llama.process.channel
    owner = take_over(stub)
    unary = [
        (f"/pagedkv.v1.Executor/{m.name}", m.input_type.full_name)
        for m in executor_pb2.DESCRIPTOR.services_by_name["Executor"].methods
        if not m.client_streaming
    ]
    unary.append(("/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest"))
    for method, message_name in unary:
        assert_undecodable(refused(channel.unary_unary(method), GARBAGE), message_name)
    # A well-formed message whose string is not UTF-8 does not decode either.
    takeover = common_pb2.Owner(owner_id="zz", epoch=next(EPOCHS))
    not_utf8 = executor_pb2.ResetRequest(owner=takeover).SerializeToString()
    not_utf8 = not_utf8.replace(b"zz", b"\xff\xff")
    reset = channel.unary_unary("/pagedkv.v1.Executor/Reset")
    assert_undecodable(refused(reset, not_utf8), "pagedkv.v1.ResetRequest")
    assert stub.GetInfo(executor_pb2.GetInfoRequest()).owner == owner
    # On the step stream, the steps before it are answered; it ends the
    # stream with its status, and nothing after it applies.
    a = Seq(0, [1, 2], 0)
    messages = [
        prefill(owner, a, "a", P_A).SerializeToString(),
        GARBAGE,
        prefill(owner, Seq(1, [3], 0), "late", P_C).SerializeToString(),
    ]
    responses = channel.stream_stream("/pagedkv.v1.Executor/StepStream")(iter(messages))
    take_samples([a], executor_pb2.StepResponse.FromString(next(responses)))
    with pytest.raises(grpc.RpcError) as error:
        next(responses)
    assert_undecodable(error.value, "pagedkv.v1.StepRequest")
    free_nothing(stub, owner, rows=[1], seq_ids=["late"])
    # The executor serves on.
    for _ in range(3):
        take_samples([a], stub.Step(decode(owner, [a])))
    assert a.output == hf_greedy(llama.model_dir, P_A, 4)


# -- sampling -----------------------------------------------------------------

SEEDED = common_pb2.SamplingParams(temperature=0.8, top_k=20, seed=123)


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch(llama: Served) -> None:
    alone = Driver(llama.stub, epoch=next(EPOCHS))
    (expected,) = alone.run([alone.add("s", P_A, 8, SEEDED)])
    batched = Driver(llama.stub, epoch=next(EPOCHS))
    other_seed = common_pb2.SamplingParams(temperature=0.8, top_k=20, seed=124)
    seqs = [
        batched.add("greedy", P_D, 8),
        batched.add("unseeded", Q_B, 8, common_pb2.SamplingParams(temperature=1.0)),
        batched.add("s", P_A, 8, SEEDED),  # another row, batched with prompt chunks
        batched.add("other-seed", P_A, 8, other_seed),
    ]
    _, _, output, other = batched.run(seqs, chunk_size=8)
    assert output == expected
    assert other != expected


@functools.cache
def hf_logprobs(model_dir: Path, prompt: tuple[int, ...]) -> torch.Tensor:
    """Hugging Face's raw log-probabilities of the token after ``prompt``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_are_the_raw_top_k_most_likely_first(llama: Served) -> None:
    stub = llama.stub
    owner = take_over(stub)
    step = executor_pb2.StepRequest(
        owner=owner,
        new_requests=[
            new_request("top3", 0, P_A, common_pb2.SamplingParams(temperature=0, logprobs=3)),
            new_request("none", 1, P_C),
            new_request("random", 2, Q_B, common_pb2.SamplingParams(seed=5, logprobs=1)),
        ],
        num_scheduled_tokens=[19, 5, 24],
        num_computed_tokens=[0, 0, 0],
        continue_from_sampled=[False] * 3,
        needs_sample=[True] * 3,
        block_table_starts=[0, 0, 0],
        new_block_counts=[2, 1, 2],
        new_block_ids=[1, 2, 3, 4, 5],
    )
    response = stub.Step(step)
    assert list(response.num_top_logprobs) == [3, 0, 1]
    top_ids, top_logprobs = list(response.top_token_ids), list(response.top_logprobs)
    assert (len(top_ids), len(top_logprobs)) == (4, 4)
    assert top_logprobs[:3] == sorted(top_logprobs[:3], reverse=True)
    # Greedy: the sampled token is the most likely one, with the same logprob.
    assert response.sampled_token_ids[0] == top_ids[0]
    assert response.sampled_logprobs[0] == top_logprobs[0]
    reference = hf_logprobs(llama.model_dir, tuple(P_A))
    expected = reference.topk(3)
    assert top_ids[:3] == expected.indices.tolist()
    assert top_logprobs[:3] == pytest.approx(expected.values.tolist(), abs=1e-4)
    # Random: the logprobs are under the raw distribution, not the sampling one.
    reference = hf_logprobs(llama.model_dir, tuple(Q_B))
    sampled = response.sampled_token_ids[2]
    assert response.sampled_logprobs[2] == pytest.approx(reference[sampled].item(), abs=1e-4)
    assert top_ids[3] == reference.argmax().item()
