"""Block tags on the executor (``tag_*`` / ``untag_block_ids`` in steps,
``ListCachedBlocks``, ``Reset.drop_cached_blocks``, ``num_tagged_blocks``).

``BlockTags`` itself is tested in process; the rest against a real executor
process (one llama executor for the module, each test starting from a Reset
with a fresh epoch). The test that matters most: a scheduler that takes the
executor over rebuilds a prefix-cache hit from the tags alone, and the request
built on the tagged blocks gives Hugging Face's greedy tokens.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.common.ids import BlockHash, BlockId
from pagedkv.executor.block_tags import BlockTags
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from tests.executor.driver import ExecutorProcess
from tests.executor.test_executor_api import (
    BLOCK_SIZE,
    FENCED,
    INVALID,
    LIMITS,
    NUM_BLOCKS,
    P_A,
    P_D,
    Seq,
    assert_status,
    decode,
    new_request,
    prefill,
    refused,
    take_samples,
)
from tests.executor.test_generation import hf_greedy
from tests.executor.test_gpu import hf_greedy_cuda

EPOCHS = itertools.count(1)

Tag = tuple[int, bytes, int]  # (block id, hash, group)


def h(name: str) -> bytes:
    """A 16-byte hash for a test tag."""
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


# -- BlockTags, in process ----------------------------------------------------


def listed(tags: BlockTags, chunk_size: int = 8192) -> list[Tag]:
    return [
        (int(b), bytes(x), g)
        for chunk in tags.chunks(chunk_size)
        for b, x, g in zip(*chunk, strict=True)
    ]


def tag(tags: BlockTags, *items: Tag) -> None:
    tags.tag(
        [BlockId(b) for b, _, _ in items],
        [BlockHash(x) for _, x, _ in items],
        [g for *_, g in items],
    )


def test_tags_are_kept_in_tag_order_and_a_retag_moves_the_block_to_the_end() -> None:
    tags = BlockTags()
    tag(tags, (5, h("a"), 0), (3, h("b"), 1), (9, h("c"), 0))
    tag(tags, (5, h("a2"), 1))
    tags.untag([BlockId(42), BlockId(3), BlockId(3)])  # 42 has no tag: nothing happens
    assert listed(tags) == [(9, h("c"), 0), (5, h("a2"), 1)]
    assert (len(tags), 5 in tags, 3 in tags) == (2, True, False)
    tags.check_integrity(num_blocks=10, num_groups=2)
    assert tags.clear() == 2
    assert (listed(tags), tags.chunks()) == ([], [])


def test_a_touch_moves_tagged_blocks_to_the_end_in_turn() -> None:
    tags = BlockTags()
    tag(tags, (1, h("a"), 0), (2, h("b"), 0), (3, h("c"), 0), (4, h("d"), 0))
    tags.touch([BlockId(b) for b in (3, 8, 1)])  # 8 has no tag: nothing happens
    assert [b for b, _, _ in listed(tags)] == [2, 4, 3, 1]
    assert listed(tags)[-1] == (1, h("a"), 0)  # the tag itself is kept


def test_an_offloaded_host_block_takes_its_source_blocks_tag_or_loses_its_own() -> None:
    tags, host_tags = BlockTags(), BlockTags()
    tag(tags, (1, h("a"), 0), (2, h("b"), 1))
    tag(host_tags, (7, h("old7"), 0), (8, h("old8"), 0), (9, h("old9"), 0))
    # Block 1 -> host 8 (retagged, moved to the end), block 5 (untagged) ->
    # host 7 (its old tag dropped), block 2 -> host 4 (a new tag).
    host_tags.take_tags(tags, np.array([[1, 8], [5, 7], [2, 4]]))
    assert listed(host_tags) == [(9, h("old9"), 0), (8, h("a"), 0), (4, h("b"), 1)]
    assert listed(tags) == [(1, h("a"), 0), (2, h("b"), 1)]  # the device's tags stay


def test_chunks_are_a_snapshot_of_at_most_chunk_size_tags() -> None:
    tags = BlockTags()
    tag(tags, *((b, h(str(b)), 0) for b in range(1, 11)))
    chunks = tags.chunks(4)
    tags.untag([BlockId(1)])  # after the snapshot: the chunks do not change
    assert [len(c.block_ids) for c in chunks] == [4, 4, 2]
    assert [b for c in chunks for b in c.block_ids] == list(range(1, 11))
    assert tuple(map(list, chunks[0])) == ([1, 2, 3, 4], [h(str(b)) for b in range(1, 5)], [0] * 4)


# -- the executor process -----------------------------------------------------


def serve(model_dir: Path, num_blocks: int = NUM_BLOCKS) -> ExecutorProcess:
    return ExecutorProcess(model_dir, num_blocks=num_blocks, extra_args=LIMITS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tags") / "llama"
    make_tiny_model(path, "llama", seed=7)
    return path


@pytest.fixture(scope="module")
def process(model_dir: Path) -> Iterator[ExecutorProcess]:
    served = serve(model_dir)
    with served:
        yield served


@pytest.fixture
def stub(process: ExecutorProcess) -> executor_pb2_grpc.ExecutorStub:
    return process.stub


def take_over(
    stub: executor_pb2_grpc.ExecutorStub, owner_id: str = "test", drop: bool = False
) -> common_pb2.Owner:
    owner = common_pb2.Owner(owner_id=owner_id, epoch=next(EPOCHS))
    stub.Reset(executor_pb2.ResetRequest(owner=owner, drop_cached_blocks=drop))
    return owner


def list_tags(stub: executor_pb2_grpc.ExecutorStub, owner: common_pb2.Owner) -> list[Tag]:
    """Every tag, in the order listed; checks GetInfo's count agrees."""
    tags = [
        (b, x, g)
        for chunk in stub.ListCachedBlocks(executor_pb2.ListCachedBlocksRequest(owner=owner))
        for b, x, g in zip(chunk.block_ids, chunk.block_hashes, chunk.group_ids, strict=True)
    ]
    assert stub.GetInfo(executor_pb2.GetInfoRequest()).num_tagged_blocks == len(tags)
    return tags


def tagging(owner: common_pb2.Owner, *items: Tag, untag: tuple[int, ...] = ()) -> Any:
    """A step with no entries that only (un)tags."""
    return executor_pb2.StepRequest(
        owner=owner,
        untag_block_ids=untag,
        tag_block_ids=[b for b, _, _ in items],
        tag_block_hashes=[x for _, x, _ in items],
        tag_group_ids=[g for *_, g in items],
    )


def test_tags_are_listed_in_tag_order_on_step_and_stream(
    stub: executor_pb2_grpc.ExecutorStub,
) -> None:
    owner = take_over(stub, drop=True)
    assert list_tags(stub, owner) == []
    stub.Step(tagging(owner, (5, h("a"), 0), (3, h("b"), 0)))
    assert list_tags(stub, owner) == [(5, h("a"), 0), (3, h("b"), 0)]
    # On the stream: a re-tag moves 5 to the end with its new hash; untagging
    # a block without a tag (9) does nothing.
    responses = stub.StepStream(
        iter(
            [
                tagging(owner, (7, h("c"), 0)),
                tagging(owner, (5, h("a2"), 0), untag=(9,)),
            ]
        )
    )
    assert len(list(responses)) == 2
    assert list_tags(stub, owner) == [(3, h("b"), 0), (7, h("c"), 0), (5, h("a2"), 0)]
    stub.Step(tagging(owner, untag=(3, 3, 7)))
    assert list_tags(stub, owner) == [(5, h("a2"), 0)]


def test_an_untag_and_a_tag_of_one_block_in_one_step_keep_the_new_tag(
    stub: executor_pb2_grpc.ExecutorStub,
) -> None:
    owner = take_over(stub, drop=True)
    stub.Step(tagging(owner, (4, h("old"), 0), (6, h("six"), 0)))
    stub.Step(tagging(owner, (4, h("new"), 0), untag=(4, 6)))
    assert list_tags(stub, owner) == [(4, h("new"), 0)]


def test_a_freed_rows_blocks_are_listed_tail_first_after_older_tags(
    stub: executor_pb2_grpc.ExecutorStub,
) -> None:
    """A row's blocks become the newest tags when a step frees the row (a
    reset frees every live row), each row's from its last block to its first,
    as a scheduler releases them: a new owner that adopts the listing evicts
    a prefix's tail before its head."""
    owner = take_over(stub, drop=True)
    d, e = Seq(0, [1, 2, 3], 0), Seq(1, [4, 5, 6], 0)
    step = prefill(owner, d, "D", P_D)
    step.MergeFrom(tagging(owner, (1, h("d1"), 0), (2, h("d2"), 0)))
    take_samples([d], stub.Step(step))
    step = prefill(owner, e, "E", P_D)
    step.MergeFrom(tagging(owner, (4, h("e1"), 0), (5, h("e2"), 0), (9, h("other"), 0)))
    take_samples([e], stub.Step(step))
    assert [b for b, _, _ in list_tags(stub, owner)] == [1, 2, 4, 5, 9]
    stub.Step(executor_pb2.StepRequest(owner=owner, freed_rows=[d.row]))
    assert [b for b, _, _ in list_tags(stub, owner)] == [4, 5, 9, 2, 1]
    new = take_over(stub, "new")  # frees E's row, still live
    assert list_tags(stub, new) == [
        (9, h("other"), 0),
        (2, h("d2"), 0),
        (1, h("d1"), 0),
        (5, h("e2"), 0),
        (4, h("e1"), 0),
    ]


def test_copies_drop_the_tags_of_their_destinations(stub: executor_pb2_grpc.ExecutorStub) -> None:
    """A copy overwrites a block's KV, so its old tag would lie; a tag the
    same step sets is kept (tags apply after the copies)."""
    owner = take_over(stub, drop=True)
    stub.Step(tagging(owner, (2, h("two"), 0), (3, h("three"), 0), (4, h("four"), 0)))
    stub.CopyBlocks(
        executor_pb2.CopyBlocksRequest(owner=owner, src_block_ids=[1], dst_block_ids=[2])
    )
    step = tagging(owner, (4, h("four2"), 0))
    step.copy_src_block_ids[:] = [1, 1]
    step.copy_dst_block_ids[:] = [3, 4]
    stub.Step(step)
    assert list_tags(stub, owner) == [(4, h("four2"), 0)]


# A decode of A (row 0, 19 prompt tokens in blocks 1 and 2) that untags
# block 1 and tags 1, 3 and 4: each case breaks one field of it.
TAG_STEP: dict[str, Any] = dict(
    untag_block_ids=[1],
    tag_block_ids=[1, 3, 4],
    tag_block_hashes=[h("A0'"), h("three"), h("four")],
    tag_group_ids=[0, 0, 0],
)


def bad(field_name: str, **changes: Any) -> Any:
    return pytest.param(changes, field_name, id=field_name.rstrip(":"))


BAD_TAGS = [
    bad("untag_block_ids[1]", untag_block_ids=[1, NUM_BLOCKS]),
    bad("untag_block_ids[0]", untag_block_ids=[0]),
    bad("tag_block_ids[2]", tag_block_ids=[1, 3, 9000]),
    bad("tag_block_ids[1]", tag_block_ids=[1, 0, 4]),
    bad("tag_block_ids[2]", tag_block_ids=[1, 3, 1]),  # repeats
    bad("tag_block_hashes:", tag_block_hashes=[h("x"), h("y")]),
    bad("tag_block_hashes:", tag_block_ids=[], tag_group_ids=[]),
    bad("tag_group_ids:", tag_group_ids=[0, 0, 0, 0]),
    bad("tag_block_hashes[1]", tag_block_hashes=[h("x"), b"", h("z")]),
    bad("tag_block_hashes[0]", tag_block_hashes=[b"x" * 65, h("y"), h("z")]),
    bad("tag_group_ids[2]", tag_group_ids=[0, 0, 1]),  # the llama has one group
    bad("rows[0]", rows=[5]),  # a refusal of any other field keeps the tags too
]


@pytest.mark.parametrize(("changes", "field_name"), BAD_TAGS)
def test_a_bad_tag_column_is_refused_naming_its_field_and_changes_nothing(
    stub: executor_pb2_grpc.ExecutorStub, model_dir: Path, changes: dict[str, Any], field_name: str
) -> None:
    owner = take_over(stub, drop=True)
    a = Seq(0, [1, 2], 0)
    take_samples([a], stub.Step(prefill(owner, a, "A", P_A)))
    stub.Step(tagging(owner, (1, h("A0"), 0)))
    step = decode(owner, [a])
    request = executor_pb2.StepRequest()
    request.CopyFrom(step)
    for name, value in {**TAG_STEP, **changes}.items():
        request.ClearField(name)
        getattr(request, name).extend(value)
    error = refused(stub.Step, request)
    assert_status(error, INVALID, field_name)
    # Untags apply before a step's writes and tags after them, but only once
    # the whole message is valid: the refused step changed no tag and no row.
    assert list_tags(stub, owner) == [(1, h("A0"), 0)]
    step.MergeFrom(executor_pb2.StepRequest(**TAG_STEP))
    take_samples([a], stub.Step(step))
    assert a.output == hf_greedy(model_dir, P_A, 2)
    assert list_tags(stub, owner) == [(1, h("A0'"), 0), (3, h("three"), 0), (4, h("four"), 0)]


def test_reset_keeps_the_tags_unless_told_to_drop_them(
    stub: executor_pb2_grpc.ExecutorStub,
) -> None:
    owner = take_over(stub, drop=True)
    stub.Step(tagging(owner, (8, h("eight"), 0)))
    stub.Reset(executor_pb2.ResetRequest(owner=owner))  # the owner's restart
    assert list_tags(stub, owner) == [(8, h("eight"), 0)]
    new = take_over(stub, "next")  # a takeover
    assert list_tags(stub, new) == [(8, h("eight"), 0)]
    newer = take_over(stub, "next", drop=True)
    assert list_tags(stub, newer) == []


def test_only_the_current_owner_may_list_the_tags(stub: executor_pb2_grpc.ExecutorStub) -> None:
    old = take_over(stub, "old", drop=True)
    stub.Step(tagging(old, (8, h("eight"), 0)))
    current = take_over(stub, "current")
    for owner, code, field_name in [
        (old, FENCED, "owner"),  # stale
        (common_pb2.Owner(owner_id="other", epoch=current.epoch), FENCED, "owner"),  # foreign
        (common_pb2.Owner(owner_id="later", epoch=current.epoch + 1), FENCED, "owner"),  # no Reset
        (common_pb2.Owner(owner_id="current"), INVALID, "owner.epoch"),
    ]:
        request = executor_pb2.ListCachedBlocksRequest(owner=owner)
        assert_status(refused(lambda r: list(stub.ListCachedBlocks(r)), request), code, field_name)
    assert list_tags(stub, current) == [(8, h("eight"), 0)]


def test_an_undecodable_listing_request_is_invalid_argument(process: ExecutorProcess) -> None:
    assert process.channel is not None
    call = process.channel.unary_stream("/pagedkv.v1.Executor/ListCachedBlocks")
    error = refused(lambda r: list(call(r)), b"\xff\xff\xff")
    details = "the request is not a valid pagedkv.v1.ListCachedBlocksRequest message"
    assert (error.code(), error.details()) == (INVALID, details)


def block_hashes(tokens: list[int]) -> list[bytes]:
    """A prefix-cache hash per full block: each chains the previous one, so
    it names the whole prefix up to the block's end."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = np.asarray(tokens[start : start + BLOCK_SIZE], dtype=np.uint32).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


def test_a_new_owner_serves_a_prefix_hit_from_the_tags_as_a_full_recompute(
    stub: executor_pb2_grpc.ExecutorStub,
    model_dir: Path,
    greedy: Callable[[Path, list[int], int], list[int]] = hf_greedy,
    logprob_tolerance: float = 1e-4,
) -> None:
    """The old owner runs P_D (40 tokens: blocks 1 and 2 full, 3 partial),
    tagging its full blocks in the prefill step itself, and decodes on. The
    new owner knows nothing but the tags: it lists them, finds Q's first two
    blocks by hash and starts Q (P_D's first 32 tokens and a tail of its own)
    at num_computed_tokens 32 on those blocks. Q then samples what a second
    row computing all of Q samples, logprobs included (the tokens of a tiny
    random model alone hardly depend on the prefix's KV), and Hugging Face's
    greedy tokens (``greedy``: on the executor's device); the logprobs
    within ``logprob_tolerance``."""
    old = take_over(stub, "old", drop=True)
    d = Seq(0, [1, 2, 3], 0)
    step = prefill(old, d, "D", P_D)
    hashes = block_hashes(P_D)
    step.MergeFrom(tagging(old, (1, hashes[0], 0), (2, hashes[1], 0)))
    take_samples([d], stub.Step(step))
    spare = iter(range(4, NUM_BLOCKS))
    for _ in range(4):
        take_samples([d], stub.Step(decode(old, [d], spare)))
    assert d.output == hf_greedy(model_dir, P_D, 5)

    new = take_over(stub, "new")  # frees D's row; KV and tags stay
    index = {block_hash: block_id for block_id, block_hash, _ in list_tags(stub, new)}
    q = P_D[:32] + list(b" -- and then a tail")
    hits = [index[x] for x in block_hashes(q) if x in index]
    assert hits == [1, 2]
    hit = Seq(1, [*hits, 20, 21], len(q))  # 51 tokens, and 8 decodes, fit 4 blocks
    full = Seq(2, [30, 31, 32, 33], len(q))
    logprobs: dict[int, list[float]] = {hit.row: [], full.row: []}

    def run(seqs: list[Seq], request: executor_pb2.StepRequest) -> None:
        response = stub.Step(request)
        take_samples(seqs, response)
        for row, logprob in zip(response.sampled_rows, response.sampled_logprobs, strict=True):
            logprobs[row].append(logprob)

    for seq, num_computed in ((hit, 32), (full, 0)):  # the hit computes Q's tail only
        start = executor_pb2.StepRequest(
            owner=new,
            new_requests=[new_request(f"Q{seq.row}", seq.row, q)],
            num_scheduled_tokens=[len(q) - num_computed],
            num_computed_tokens=[num_computed],
            continue_from_sampled=[False],
            needs_sample=[True],
            block_table_starts=[0],
            new_block_counts=[4],
            new_block_ids=seq.blocks,
        )
        run([seq], start)
    for _ in range(8):
        run([hit, full], decode(new, [hit, full]))
    assert hit.output == full.output == greedy(model_dir, q, 9)
    assert logprobs[hit.row] == pytest.approx(logprobs[full.row], abs=logprob_tolerance)


# -- other processes ----------------------------------------------------------


def test_a_new_incarnation_lists_no_tags(
    stub: executor_pb2_grpc.ExecutorStub, model_dir: Path
) -> None:
    """Tags live with the process: the module's executor has some, a newly
    started one (a restart) has none, and refuses to list before its first
    Reset (epoch 0, no owner)."""
    owner = take_over(stub, drop=True)
    stub.Step(tagging(owner, (8, h("eight"), 0)))
    info = stub.GetInfo(executor_pb2.GetInfoRequest())
    restarted = serve(model_dir)
    with restarted:
        fresh = restarted.stub
        fresh_info = fresh.GetInfo(executor_pb2.GetInfoRequest())
        assert fresh_info.incarnation_id != info.incarnation_id
        assert (fresh_info.owner.epoch, fresh_info.num_tagged_blocks) == (0, 0)
        request = executor_pb2.ListCachedBlocksRequest(owner=owner)
        assert_status(refused(lambda r: list(fresh.ListCachedBlocks(r)), request), FENCED, "owner")
        fresh.Reset(executor_pb2.ResetRequest(owner=owner))
        assert list_tags(fresh, owner) == []
    assert list_tags(stub, owner) == [(8, h("eight"), 0)]


def test_more_tags_than_a_chunk_are_listed_in_chunks_of_8192(model_dir: Path) -> None:
    num_blocks = 8192 + 100
    big = serve(model_dir, num_blocks=num_blocks)
    with big:
        owner = take_over(big.stub)
        block_ids = list(range(num_blocks - 1, 0, -1))  # every block, highest first
        big.stub.Step(tagging(owner, *((b, h(str(b)), 0) for b in block_ids)))
        chunks = list(big.stub.ListCachedBlocks(executor_pb2.ListCachedBlocksRequest(owner=owner)))
        assert [len(c.block_ids) for c in chunks] == [8192, 99]
        assert [b for c in chunks for b in c.block_ids] == block_ids
        assert [x for c in chunks for x in c.block_hashes] == [h(str(b)) for b in block_ids]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_new_owner_serves_a_prefix_hit_from_the_tags_as_a_full_recompute(
    model_dir: Path,
) -> None:
    """The same takeover on a CUDA executor (Triton kernels, decode steps
    replayed from CUDA graphs): tags are set once the device has run the step.
    The Triton kernels' float32 products round their operands to TF32 (10
    mantissa bits), and the hit's prefix is read through the cache where the
    full row computes it in its own tiles: the sums' orders differ, and the
    logprobs by up to 6e-4 on an H100."""
    cuda = ExecutorProcess(
        model_dir, backend="triton", device="cuda", num_blocks=NUM_BLOCKS, extra_args=LIMITS
    )
    with cuda:
        test_a_new_owner_serves_a_prefix_hit_from_the_tags_as_a_full_recompute(
            cuda.stub, model_dir, hf_greedy_cuda, logprob_tolerance=2e-3
        )
