"""Fencing epochs past ``MAX_EPOCH`` (2^63 - 1, ``Owner.epoch`` in
common.proto) against a real executor process: refused with INVALID_ARGUMENT
naming ``owner.epoch`` on Reset and on every mutating call, changing nothing,
so that a scheduler can always take over with ``epoch + 1`` as long as the
executor is below the maximum.

The module has its own executor: once it is at the maximum epoch, no other
owner can take it over.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedkv.common.ids import MAX_EPOCH
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from tests.executor.driver import GREEDY, ExecutorProcess

PROMPT = list(b"Hello, paged world!")  # 19 tokens: blocks 1 and 2


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[executor_pb2_grpc.ExecutorStub]:
    model_dir: Path = tmp_path_factory.mktemp("fencing") / "llama"
    make_tiny_model(model_dir, "llama", seed=7)
    with ExecutorProcess(model_dir, num_blocks=16, extra_args=("--max-num-rows", "4")) as process:
        yield process.stub


def owner_of(stub: executor_pb2_grpc.ExecutorStub) -> common_pb2.Owner:
    return stub.GetInfo(executor_pb2.GetInfoRequest()).owner


def assert_epoch_refused(call: grpc.UnaryUnaryMultiCallable, request: object) -> None:
    with pytest.raises(grpc.RpcError) as error:
        call(request)
    code, details = error.value.code(), error.value.details()
    assert (code, details.startswith("owner.epoch:")) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        True,
    ), details


def prefill(owner: common_pb2.Owner, seq_id: str, row: int) -> executor_pb2.StepRequest:
    return executor_pb2.StepRequest(
        owner=owner,
        new_requests=[
            executor_pb2.NewRequest(
                seq_id=seq_id, row=row, prompt_token_ids=PROMPT, sampling=GREEDY
            )
        ],
        num_scheduled_tokens=[len(PROMPT)],
        num_computed_tokens=[0],
        continue_from_sampled=[False],
        needs_sample=[True],
        block_table_starts=[0],
        new_block_counts=[2],
        new_block_ids=[2 * row + 1, 2 * row + 2],
    )


def test_an_epoch_past_the_maximum_is_refused_on_every_call_and_changes_nothing(
    stub: executor_pb2_grpc.ExecutorStub,
) -> None:
    owner = common_pb2.Owner(owner_id="alpha", epoch=1)
    stub.Reset(executor_pb2.ResetRequest(owner=owner))
    stub.Step(prefill(owner, "a", 0))
    for epoch in (MAX_EPOCH + 1, 2**64 - 1):
        for owner_id in ("alpha", "beta"):
            past = common_pb2.Owner(owner_id=owner_id, epoch=epoch)
            assert_epoch_refused(stub.Reset, executor_pb2.ResetRequest(owner=past))
            assert_epoch_refused(stub.Step, prefill(past, "b", 1))
            assert_epoch_refused(
                stub.Allocate,
                executor_pb2.AllocateRequest(
                    owner=past,
                    rows=[0],
                    block_table_starts=[2],
                    new_block_counts=[1],
                    new_block_ids=[9],
                ),
            )
            assert_epoch_refused(stub.Free, executor_pb2.FreeRequest(owner=past, rows=[0]))
            assert_epoch_refused(
                stub.CopyBlocks,
                executor_pb2.CopyBlocksRequest(owner=past, src_block_ids=[1], dst_block_ids=[9]),
            )
            assert owner_of(stub) == owner
    # Nothing changed: "a" is live in row 0 and "b" is not.
    freed = stub.Free(executor_pb2.FreeRequest(owner=owner, seq_ids=["a", "b"]))
    assert list(freed.freed_rows) == [0]


def test_the_maximum_epoch_takes_over_and_nothing_takes_over_from_it(
    stub: executor_pb2_grpc.ExecutorStub,
) -> None:
    top = common_pb2.Owner(owner_id="top", epoch=MAX_EPOCH)
    previous = owner_of(stub)
    reset = stub.Reset(executor_pb2.ResetRequest(owner=top))
    assert reset.previous_owner == previous
    assert owner_of(stub) == top
    stub.Step(prefill(top, "t", 0))  # the owner at the maximum works as any other
    for epoch in (MAX_EPOCH + 1, 2**64 - 1):
        past = common_pb2.Owner(owner_id="next", epoch=epoch)
        assert_epoch_refused(stub.Reset, executor_pb2.ResetRequest(owner=past))
    assert owner_of(stub) == top
    # The owner at the maximum can still restart its own session.
    stub.Reset(executor_pb2.ResetRequest(owner=top))
    freed = stub.Free(executor_pb2.FreeRequest(owner=top, seq_ids=["t"]))
    assert list(freed.freed_rows) == []
