"""The host KV tier (host_kv.py): a step's offloads copy device blocks to
host blocks and its loads copy them back, before anything else of the step.

In process on the CPU (a tiny llama, the torch kernels): blocks that hold a
prompt's KV come back byte for byte, every layer's K and V, into other
blocks, across a reset; a load reads what the same step's offloads wrote; a
request continued on loaded blocks (in the step that loads them, a single
step or a decode window) samples the tokens it samples without the round
trip; a host hit (a new request whose prefix its step loads) samples what
the original request did, eager and through a mixed-step graph's forward;
load destinations lose their tags; every bad column is refused naming
its field and moves nothing; GetInfo and ``--host-kv-gib`` size the pool.
The same round trip on CUDA is marked ``gpu``.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.common.errors import InvalidArgument
from pagedkv.executor.engine import Executor
from pagedkv.executor.host_kv import HostKVPool
from pagedkv.executor.launched import LaunchedStep
from pagedkv.executor.mixed_graphs import MixedGraphs
from pagedkv.executor.model_runner import ModelRunner
from pagedkv.executor.runner_config import RunnerConfig
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.kernels.backend import get_backend
from pagedkv.v1 import common_pb2, executor_pb2
from tests.executor.driver import ExecutorProcess
from tests.executor.test_executor_api import BLOCK_SIZE, Seq, decode, prefill, take_samples
from tests.executor.test_launch_order import take_window, window

OWNER = common_pb2.Owner(owner_id="test", epoch=1)
NUM_BLOCKS = 64
HOST_KV_GIB = 0.0001  # 13 host blocks of the tiny llama's 8,192 bytes
NUM_HOST_BLOCKS = 13
PROMPT = [5, 9, 2, 7, 11, 3, 8, 1, 4, 4, 6, 10, 12, 2, 9, 5, 7, 3, 1, 8]  # 20 tokens: 2 blocks

Pairs = tuple[tuple[int, int], ...]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("host_kv") / "llama"
    make_tiny_model(path, "llama", seed=3)
    return path


def make_executor(
    model_dir: Path,
    host_kv_gib: float,
    device: str = "cpu",
    backend: str = "torch",
    fused_ops: bool = True,
    kv_cache_dtype: str = "auto",
) -> Executor:
    config = RunnerConfig(
        model=str(model_dir),
        device=device,
        kernel_backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        num_blocks=NUM_BLOCKS,
        max_num_rows=4,
        host_kv_gib=host_kv_gib,
        fused_ops=fused_ops,
    )
    runner = ModelRunner(config)
    runner.warm_up()
    return Executor(runner, "tiny")


@pytest.fixture(scope="module")
def executor(model_dir: Path) -> Iterator[Executor]:
    yield make_executor(model_dir, HOST_KV_GIB)


@pytest.fixture(scope="module")
def without_tier(model_dir: Path) -> Iterator[Executor]:
    yield make_executor(model_dir, 0.0)


# -- helpers ------------------------------------------------------------------


def fresh(executor: Executor) -> None:
    executor.reset(executor_pb2.ResetRequest(owner=OWNER, drop_cached_blocks=True))


def moving(offloads: Pairs = (), loads: Pairs = (), **fields: Any) -> executor_pb2.StepRequest:
    """A step with no entries that offloads (block, host block) pairs, then
    loads (host block, block) pairs."""
    return executor_pb2.StepRequest(
        owner=OWNER,
        offload_block_ids=[b for b, _ in offloads],
        offload_host_block_ids=[h for _, h in offloads],
        load_host_block_ids=[h for h, _ in loads],
        load_block_ids=[b for _, b in loads],
        **fields,
    )


def with_moves(
    request: executor_pb2.StepRequest, offloads: Pairs = (), loads: Pairs = ()
) -> executor_pb2.StepRequest:
    """``request`` that also offloads and loads (before its forward)."""
    request.MergeFrom(moving(offloads, loads))
    return request


def kv_of(executor: Executor, block_ids: list[int]) -> list[torch.Tensor]:
    """Each layer's K, then V, of ``block_ids``, copied to the CPU (an fp8
    cache's as its bytes, an int8 one's storage: values and scales)."""
    kv = executor.runner.kv
    index = torch.tensor(block_ids, device=executor.runner.device)
    return [raw(cache)[index].cpu() for cache in (*kv.key_storage, *kv.value_storage)]


def raw(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes (what torch's CPU ops take); others as they are."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def clobber(executor: Executor, block_ids: list[int]) -> None:
    """Overwrites ``block_ids`` in every layer (what another request's KV would do)."""
    kv = executor.runner.kv
    for cache in (*kv.key_storage, *kv.value_storage):
        raw(cache)[block_ids] = -1.0 if cache.element_size() > 1 else 0xB8  # e4m3 -1.0


def prefilled(
    executor: Executor, blocks: list[int], row: int = 0, prompt: list[int] = PROMPT
) -> Seq:
    """A request whose prompt's KV fills ``blocks``."""
    seq = Seq(row=row, blocks=blocks, num_computed=0)
    take_samples([seq], executor.step(prefill(OWNER, seq, f"r{row}", prompt)))
    return seq


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


class Steps:
    """Runs one sequence's steps in turn, or (``ahead``) each launched
    before the previous one completes, as a step stream does."""

    def __init__(self, executor: Executor, seq: Seq, ahead: bool) -> None:
        self.executor, self.seq, self.ahead = executor, seq, ahead
        self.pending: list[tuple[LaunchedStep, int]] = []

    def run(self, request: executor_pb2.StepRequest, num_samples: int = 1) -> None:
        """Launches ``request``, which samples ``num_samples`` tokens."""
        self.pending.append((self.executor.launch(request), num_samples))
        while len(self.pending) > (1 if self.ahead else 0):
            self.complete_one()

    def complete_one(self) -> None:
        launched, num_samples = self.pending.pop(0)
        response = self.executor.complete(launched)
        if num_samples:
            take_window([self.seq], response, num_samples)


# -- the round trip -----------------------------------------------------------


def round_trip_is_byte_exact(executor: Executor) -> None:
    fresh(executor)
    prefilled(executor, [1, 2])
    original = kv_of(executor, [1, 2])
    assert all(t.abs().sum() > 0 for t in original)
    # Host ids out of order and in a run; a source may repeat.
    executor.step(moving(offloads=((2, 7), (1, 3), (1, 4), (2, 5))))
    clobber(executor, [1, 2])
    fresh(executor)  # a reset keeps the host blocks
    before = kv_of(executor, list(range(NUM_BLOCKS)))
    executor.step(moving(loads=((3, 9), (7, 10), (4, 11), (5, 12), (3, 13))))
    after = kv_of(executor, list(range(NUM_BLOCKS)))
    assert_same(kv_of(executor, [9, 10]), original)
    assert_same(kv_of(executor, [11, 12]), original)
    assert_same(kv_of(executor, [13]), [t[:1] for t in original])
    others = [b for b in range(NUM_BLOCKS) if b not in (9, 10, 11, 12, 13)]
    assert_same([t[others] for t in after], [t[others] for t in before])


def test_offloaded_blocks_load_back_byte_for_byte_into_other_blocks(executor: Executor) -> None:
    round_trip_is_byte_exact(executor)


def test_a_load_reads_what_the_same_steps_offload_wrote(executor: Executor) -> None:
    fresh(executor)
    prefilled(executor, [1, 2])
    executor.step(moving(offloads=((1, 0),)))
    block_2 = kv_of(executor, [2])
    executor.step(moving(offloads=((2, 0),), loads=((0, 8),)))
    assert_same(kv_of(executor, [8]), block_2)


def continued_tokens(
    executor: Executor,
    num_steps: int,
    round_trip: bool,
    ahead: bool = False,
    loaded: bool = True,
) -> list[int]:
    """A request prefilled in blocks 1 and 2 and decoded twice; then, with
    the round trip, its blocks offloaded, overwritten, and loaded (unless not
    ``loaded``) into 3 and 4 by the step that continues it on them
    (``num_steps`` decodes); then two more decodes. Its tokens."""
    fresh(executor)
    seq = prefilled(executor, [1, 2])
    steps = Steps(executor, seq, ahead)
    for _ in range(2):
        steps.run(decode(OWNER, [seq]))
    loads: Pairs = ()
    if round_trip:
        steps.run(moving(offloads=((1, 6), (2, 2))), num_samples=0)
        clobber(executor, [1, 2, 3, 4])  # on the device after the offload, launched or not
        seq.blocks = [3, 4]
        loads = ((6, 3), (2, 4)) if loaded else ()
    if num_steps == 1:
        steps.run(with_moves(decode(OWNER, [seq]), loads=loads))
    else:
        steps.run(with_moves(window(OWNER, [seq], num_steps), loads=loads), num_steps)
    for _ in range(2):
        steps.run(decode(OWNER, [seq]))
    while steps.pending:
        steps.complete_one()
    assert seq.num_computed < 2 * BLOCK_SIZE
    return seq.output


@pytest.mark.parametrize(("kv", "dtype"), [("fp8_e4m3", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_quantized_blocks_go_to_the_host_and_back_as_their_bytes(
    model_dir: Path, kv: str, dtype: torch.dtype
) -> None:
    # The host rows hold the blocks' bytes (about half a bf16 row; an int8
    # block's scales with its values); a request continued on loaded blocks
    # samples what it samples without the round trip.
    executor = make_executor(model_dir, HOST_KV_GIB, kv_cache_dtype=kv)
    assert executor.runner.kv.key_caches[0].dtype == dtype
    round_trip_is_byte_exact(executor)
    want = continued_tokens(executor, 1, round_trip=False)
    assert continued_tokens(executor, 1, round_trip=True) == want


@pytest.mark.parametrize("num_steps", [1, 3])
def test_a_request_continued_on_loaded_blocks_samples_what_it_samples_without_the_round_trip(
    executor: Executor, num_steps: int
) -> None:
    want = continued_tokens(executor, num_steps, round_trip=False)
    assert len(want) == 1 + 2 + num_steps + 2
    assert continued_tokens(executor, num_steps, round_trip=True) == want
    assert continued_tokens(executor, num_steps, round_trip=True, ahead=True) == want
    assert continued_tokens(executor, num_steps, round_trip=True, loaded=False) != want


def test_on_transformers_layers_a_load_lands_before_each_layers_attention(
    model_dir: Path,
) -> None:
    unfused = make_executor(model_dir, HOST_KV_GIB, fused_ops=False)
    assert unfused.runner.fused is None
    want = continued_tokens(unfused, 1, round_trip=False)
    assert continued_tokens(unfused, 1, round_trip=True) == want
    assert continued_tokens(unfused, 1, round_trip=True, loaded=False) != want


def host_hit_tokens(executor: Executor, loaded: bool = True) -> tuple[list[int], list[int]]:
    """A request prefilled in blocks 1 and 2 and decoded three times; then
    its first block offloaded, it and block 3 overwritten, and the same
    prompt as a new request in row 1 whose first block is loaded (unless
    not ``loaded``) into block 3 by the step that computes the rest of its
    prompt, in block 4 (a host hit), then decoded three times. The two
    requests' tokens."""
    fresh(executor)
    seq = prefilled(executor, [1, 2])
    for _ in range(3):
        take_samples([seq], executor.step(decode(OWNER, [seq])))
    executor.step(moving(offloads=((1, 5),)))
    clobber(executor, [1, 3])
    hit = Seq(row=1, blocks=[3, 4], num_computed=0)
    request = prefill(OWNER, hit, "r1", PROMPT)
    request.num_scheduled_tokens[0] = len(PROMPT) - BLOCK_SIZE
    request.num_computed_tokens[0] = BLOCK_SIZE
    loads = ((5, 3),) if loaded else ()
    take_samples([hit], executor.step(with_moves(request, loads=loads)))
    for _ in range(3):
        take_samples([hit], executor.step(decode(OWNER, [hit])))
    return seq.output, hit.output


@pytest.mark.parametrize("mixed_graph", [False, True], ids=["eager", "uncaptured-mixed-graph"])
def test_a_host_hit_computes_the_rest_of_its_prompt_on_the_blocks_it_loads(
    executor: Executor, mixed_graph: bool
) -> None:
    """Eager, and through a mixed-step graph's padded forward (uncaptured on
    the CPU), whose segments start where the pool's chunks of layers do."""
    runner = executor.runner
    pool = runner.host_kv
    assert isinstance(pool, HostKVPool) and pool.chunk_starts() == (0, 1)
    if mixed_graph:
        runner.mixed_graphs = MixedGraphs(runner, 64, 4, capture=False, starts=pool.chunk_starts())
    try:
        want, got = host_hit_tokens(executor)
        assert len(want) == 4 and got == want
        assert host_hit_tokens(executor, loaded=False)[1] != want
    finally:
        runner.mixed_graphs = None


def layered_kv(shapes: list[tuple[int, ...]]) -> Any:
    """What a pool reads of ``KVMemory``: K and V per layer, as caches and
    as the storage block moves take (the same tensors for a float memory;
    ``shapes``: each layer's block shape), block b of layer l holding
    ``100 * l + b`` in K and its negative in V."""
    keys, values = [], []
    for layer, shape in enumerate(shapes):
        key = torch.arange(NUM_BLOCKS, dtype=torch.float32).add(100 * layer)
        keys.append(key.view(-1, *[1] * len(shape)).expand(NUM_BLOCKS, *shape).contiguous())
        values.append(keys[-1].neg())
    return SimpleNamespace(
        key_caches=tuple(keys),
        value_caches=tuple(values),
        key_storage=tuple(keys),
        value_storage=tuple(values),
    )


@pytest.mark.parametrize(
    "shapes",
    [[(BLOCK_SIZE, 2, 4)] * 5, [(BLOCK_SIZE, 2, 4), (BLOCK_SIZE, 1, 8), (BLOCK_SIZE, 2, 4)] * 2],
    ids=["uniform", "mixed-shapes"],
)
def test_a_load_lands_layer_by_layer_as_a_forward_reaches_them(
    shapes: list[tuple[int, ...]],
) -> None:
    kv = layered_kv(shapes)
    pool = HostKVPool(kv, 4, get_backend("torch"), chunks=2)
    per_chunk = -(-len(shapes) // 2)
    assert pool.num_chunks == 2
    pool.offload(np.array([5, 6]), np.array([1, 0]))
    pool.load(np.array([0, 1]), np.array([8, 9]))  # block 6 into 8, block 5 into 9
    pool.load(np.array([1]), np.array([10]))  # a second load before the forward

    def landed(layer: int) -> list[bool]:
        """Per block 8, 9, 10: whether ``layer`` holds what was loaded there."""
        k, v = kv.key_caches[layer], kv.value_caches[layer]
        return [
            bool((k[b] == 100 * layer + src).all() and (v[b] == -(100 * layer + src)).all())
            for b, src in ((8, 6), (9, 5), (10, 5))
        ]

    assert not any(any(landed(layer)) for layer in range(len(shapes)))
    pool.before_layer(0)  # the first chunk of both loads lands, the rest waits
    assert [all(landed(layer)) for layer in range(len(shapes))] == [
        layer < per_chunk for layer in range(len(shapes))
    ]
    assert not any(any(landed(layer)) for layer in range(per_chunk, len(shapes)))
    pool.before_layer(per_chunk)
    assert all(all(landed(layer)) for layer in range(len(shapes)))
    pool.load(np.array([0]), np.array([9]))
    pool.finish_loads()
    assert [
        bool((kv.key_caches[layer][9] == 100 * layer + 6).all()) for layer in range(len(shapes))
    ] == [True] * len(shapes)
    others = [b for b in range(NUM_BLOCKS) if b not in (8, 9, 10)]
    for layer in range(len(shapes)):
        assert (
            kv.key_caches[layer][others][:, 0, 0, 0] == 100 * layer + torch.tensor(others)
        ).all()


def test_load_destinations_lose_their_tags_unless_the_step_tags_them(executor: Executor) -> None:
    fresh(executor)
    prefilled(executor, [1, 2])
    executor.step(moving(offloads=((1, 0),)))
    executor.step(moving(tag_block_ids=[5, 6], tag_block_hashes=[b"a", b"b"], tag_group_ids=[0, 0]))
    executor.step(moving(loads=((0, 5),)))
    assert executor.get_info().num_tagged_blocks == 1
    executor.step(
        moving(loads=((0, 6),), tag_block_ids=[6], tag_block_hashes=[b"c"], tag_group_ids=[0])
    )
    (chunk,) = executor.list_cached_blocks(executor_pb2.ListCachedBlocksRequest(owner=OWNER))
    assert (list(chunk.block_ids), list(chunk.block_hashes)) == ([6], [b"c"])


def test_a_load_moves_its_host_blocks_tag_to_the_end_as_the_schedulers_index_does(
    executor: Executor,
) -> None:
    fresh(executor)
    prefilled(executor, [1, 2])
    tags = {"tag_block_ids": [1, 2], "tag_block_hashes": [b"p1", b"p2"], "tag_group_ids": [0, 0]}
    executor.step(moving(**tags))
    executor.step(moving(offloads=((1, 0), (2, 1))))
    executor.step(moving(loads=((0, 5),)))
    device, host = executor.list_cached_blocks(executor_pb2.ListCachedBlocksRequest(owner=OWNER))
    assert list(device.block_ids) == [1, 2]  # the device's tags keep their order
    assert (list(host.host_block_ids), list(host.host_block_hashes)) == ([1, 0], [b"p2", b"p1"])


# -- validation ---------------------------------------------------------------


# Each with a valid pair in the other columns where it has any: nothing moves.
BAD: list[tuple[str, dict[str, Any]]] = [
    (
        "offload_host_block_ids: 1 ids for 2 offload_block_ids",
        {"offload_block_ids": [1, 2], "offload_host_block_ids": [0]},
    ),
    (
        "load_block_ids: 0 ids for 1 load_host_block_ids",
        {"offload_block_ids": [1], "offload_host_block_ids": [0], "load_host_block_ids": [0]},
    ),
    (
        "offload_block_ids[1]: block 0 is the null block or >= num_blocks 64",
        {"offload_block_ids": [1, 0], "offload_host_block_ids": [0, 1]},
    ),
    (
        "load_block_ids[0]: block 64 is the null block or >= num_blocks 64",
        {"load_host_block_ids": [0], "load_block_ids": [64]},
    ),
    (
        "offload_host_block_ids[0]: host block 13 >= num_host_blocks 13",
        {"offload_block_ids": [1], "offload_host_block_ids": [13]},
    ),
    (
        "load_host_block_ids[1]: host block 13 >= num_host_blocks 13",
        {"load_host_block_ids": [0, 13], "load_block_ids": [3, 4]},
    ),
    (
        "offload_host_block_ids[1]: 4 repeats offload_host_block_ids[0]",
        {"offload_block_ids": [1, 2], "offload_host_block_ids": [4, 4]},
    ),
    (
        "load_block_ids[1]: 3 repeats load_block_ids[0]",
        {
            "offload_block_ids": [1],
            "offload_host_block_ids": [0],
            "load_host_block_ids": [0, 1],
            "load_block_ids": [3, 3],
        },
    ),
]


@pytest.mark.parametrize(("message", "columns"), BAD)
def test_a_bad_host_column_is_refused_naming_its_field_and_moves_nothing(
    executor: Executor, message: str, columns: dict[str, Any]
) -> None:
    fresh(executor)
    prefilled(executor, [1, 2])
    request = executor_pb2.StepRequest(owner=OWNER, **columns)
    pool = executor.runner.host_kv
    assert isinstance(pool, HostKVPool)
    # As bytes: host blocks never offloaded hold whatever the allocation had
    # (NaN patterns included, which compare unequal to themselves as floats).
    host_before = pool.blocks.view(torch.uint8).clone()
    kv_before = kv_of(executor, list(range(NUM_BLOCKS)))
    with pytest.raises(InvalidArgument) as error:
        executor.step(request)
    assert str(error.value) == message
    assert torch.equal(pool.blocks.view(torch.uint8), host_before)
    assert_same(kv_of(executor, list(range(NUM_BLOCKS))), kv_before)
    assert executor.runner.rows.live.tolist() == [True, False, False, False]


@pytest.mark.parametrize("column", ["offload_host_block_ids", "load_host_block_ids"])
def test_an_executor_without_a_host_tier_refuses_any_host_block(
    without_tier: Executor, column: str
) -> None:
    fresh(without_tier)
    request = moving(offloads=((1, 0),)) if column.startswith("off") else moving(loads=((0, 1),))
    with pytest.raises(InvalidArgument, match=f"^{column}: the executor has no host tier"):
        without_tier.step(request)
    assert without_tier.get_info().num_host_blocks == 0
    assert without_tier.runner.host_kv is None


# -- sizing -------------------------------------------------------------------


def test_get_info_reports_the_host_blocks_that_fit_in_the_gib(executor: Executor) -> None:
    runner = executor.runner
    assert runner.bytes_per_block == 8192
    assert math.floor(HOST_KV_GIB * 2**30 / runner.bytes_per_block) == NUM_HOST_BLOCKS
    assert executor.get_info().num_host_blocks == NUM_HOST_BLOCKS
    pool = runner.host_kv
    assert isinstance(pool, HostKVPool)
    assert pool.num_blocks == NUM_HOST_BLOCKS
    assert pool.elements_per_block == runner.bytes_per_block // 4  # float32
    assert pool.num_bytes == NUM_HOST_BLOCKS * runner.bytes_per_block


def test_the_cli_option_sizes_the_host_tier(model_dir: Path) -> None:
    args = ("--host-kv-gib", str(HOST_KV_GIB))
    process = ExecutorProcess(model_dir, num_blocks=NUM_BLOCKS, extra_args=args)
    with process:
        info = process.stub.GetInfo(executor_pb2.GetInfoRequest())
        assert info.num_host_blocks == NUM_HOST_BLOCKS
        # Measured while warming up: a prefill token, a load and its blocks.
        assert info.prefill_seconds_per_token > 0
        assert info.host_load_seconds + info.host_load_seconds_per_block > 0
        assert f"{NUM_HOST_BLOCKS} host blocks" in process.ready_line


@pytest.mark.parametrize(
    ("gib", "error"),
    [
        ("1e-9", "host_kv_gib: 1e-09 GiB holds no KV block of 8192 bytes"),
        ("-1", "host_kv_gib: -1.0 is not a size >= 0"),
    ],
)
def test_a_host_tier_of_no_block_is_a_startup_error(model_dir: Path, gib: str, error: str) -> None:
    command = [sys.executable, "-m", "pagedkv.executor", "--model", str(model_dir)]
    command += ["--num-blocks", str(NUM_BLOCKS), "--kernel-backend", "torch", "--host-kv-gib", gib]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert f"pagedkv executor: {error}" in done.stderr.splitlines()


# -- on CUDA ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_round_trip_is_byte_exact_and_a_load_feeds_its_steps_forward(
    model_dir: Path,
) -> None:
    """Pinned host blocks, the pool's copy stream (decode steps replayed
    from CUDA graphs): the bytes come back, and the forward of the step that
    loads reads the loaded KV, also launched behind earlier steps."""
    cuda = make_executor(model_dir, HOST_KV_GIB, device="cuda", backend="triton")
    pool = cuda.runner.host_kv
    assert isinstance(pool, HostKVPool) and pool.blocks.is_pinned()
    round_trip_is_byte_exact(cuda)
    for num_steps in (1, 3):
        want = continued_tokens(cuda, num_steps, round_trip=False)
        assert continued_tokens(cuda, num_steps, round_trip=True) == want
        assert continued_tokens(cuda, num_steps, round_trip=True, ahead=True) == want
        assert continued_tokens(cuda, num_steps, round_trip=True, loaded=False) != want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_host_hit_replays_its_mixed_graph_in_segments_as_its_load_lands(
    model_dir: Path,
) -> None:
    cuda = make_executor(model_dir, HOST_KV_GIB, device="cuda", backend="triton")
    pool, graphs = cuda.runner.host_kv, cuda.runner.mixed_graphs
    assert isinstance(pool, HostKVPool) and graphs is not None
    assert graphs.starts == pool.chunk_starts() == (0, 1)
    assert all(len(graph.segments) == 2 for graph in graphs.graphs)
    want, got = host_hit_tokens(cuda)
    assert len(want) == 4 and got == want
    assert host_hit_tokens(cuda, loaded=False)[1] != want


def offloaded_blocks_survive_a_step_that_reuses_them(executor: Executor) -> None:
    """An offload, then at once (launched, not awaited) a step whose new
    request takes the offloaded blocks and writes its prompt there: that
    step waits for the offload, which reads the former KV."""
    fresh(executor)
    prefilled(executor, [1, 2])
    original = kv_of(executor, [1, 2])
    offload = executor.launch(moving(offloads=((1, 0), (2, 1))))
    other = Seq(row=1, blocks=[1, 2], num_computed=0)
    reuse = executor.launch(prefill(OWNER, other, "r1", PROMPT[::-1]))
    executor.complete(offload)
    executor.complete(reuse)
    assert not all(
        torch.equal(a, b) for a, b in zip(kv_of(executor, [1, 2]), original, strict=True)
    )
    executor.step(moving(loads=((0, 5), (1, 6))))
    assert_same(kv_of(executor, [5, 6]), original)


def test_offloaded_blocks_survive_a_step_that_reuses_them(executor: Executor) -> None:
    offloaded_blocks_survive_a_step_that_reuses_them(executor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_step_that_reuses_an_offloaded_block_waits_for_the_offload(
    model_dir: Path,
) -> None:
    """The offload runs beside later steps (the compute stream does not wait
    for it) but not beside one that writes into its blocks."""
    cuda = make_executor(model_dir, HOST_KV_GIB, device="cuda", backend="triton")
    for _ in range(5):
        offloaded_blocks_survive_a_step_that_reuses_them(cuda)


def a_load_into_a_block_an_offload_still_reads_waits_for_it(executor: Executor) -> None:
    """Offloads launched, not awaited, then at once a step that loads other
    host blocks into the offloaded device blocks: the load's host copy runs
    beside the offload, but its write into the device blocks waits for the
    offload, which copies out the former KV."""
    fresh(executor)
    prefilled(executor, [1, 2])
    original = kv_of(executor, [1, 2])
    prefilled(executor, [3, 4], row=1, prompt=PROMPT[::-1])
    executor.step(moving(offloads=((3, 5), (4, 6))))
    other = kv_of(executor, [3, 4])
    assert not all(torch.equal(a, b) for a, b in zip(other, original, strict=True))
    offload = executor.launch(moving(offloads=((1, 0), (2, 1))))
    load = executor.launch(moving(loads=((5, 1), (6, 2))))
    executor.complete(offload)
    executor.complete(load)
    assert_same(kv_of(executor, [1, 2]), other)
    executor.step(moving(loads=((0, 7), (1, 8))))
    assert_same(kv_of(executor, [7, 8]), original)


def test_a_load_into_a_block_an_offload_still_reads_waits_for_it(executor: Executor) -> None:
    a_load_into_a_block_an_offload_still_reads_waits_for_it(executor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_load_into_a_block_an_offload_still_reads_waits_for_it(
    model_dir: Path,
) -> None:
    cuda = make_executor(model_dir, HOST_KV_GIB, device="cuda", backend="triton")
    for _ in range(5):
        a_load_into_a_block_an_offload_still_reads_waits_for_it(cuda)


def a_takeover_while_offloads_are_in_flight_loads_whole_blocks(executor: Executor) -> None:
    """The owner launches offloads of tagged blocks and is gone before they
    finish; a new owner takes the executor over with its cache, finds the
    host blocks listed, reuses the device blocks at once and loads the host
    blocks back: it reads what the offloads copied, whole."""
    fresh(executor)
    prefilled(executor, [1, 2])
    original = kv_of(executor, [1, 2])
    tags = {"tag_block_ids": [1, 2], "tag_block_hashes": [b"p1", b"p2"], "tag_group_ids": [0, 0]}
    executor.step(moving(**tags))
    in_flight = executor.launch(moving(offloads=((1, 3), (2, 4))))  # never awaited by its owner
    new = common_pb2.Owner(owner_id="next", epoch=OWNER.epoch + 1)
    executor.reset(executor_pb2.ResetRequest(owner=new))
    listing = executor.list_cached_blocks(executor_pb2.ListCachedBlocksRequest(owner=new))
    host = {
        bytes(h): b
        for c in listing
        for h, b in zip(c.host_block_hashes, c.host_block_ids, strict=True)
    }
    assert host == {b"p1": 3, b"p2": 4}
    other = Seq(row=1, blocks=[1, 2], num_computed=0)  # the device blocks, reused
    request = prefill(OWNER, other, "r1", PROMPT[::-1])
    request.owner.CopyFrom(new)
    reuse = executor.launch(request)
    load = moving(loads=((3, 7), (4, 8)))
    load.owner.CopyFrom(new)
    executor.step(load)
    executor.complete(reuse)
    executor.complete(in_flight)
    assert_same(kv_of(executor, [7, 8]), original)


def test_a_takeover_while_offloads_are_in_flight_loads_whole_blocks(model_dir: Path) -> None:
    executor = make_executor(model_dir, HOST_KV_GIB)  # its own: the takeover raises the epoch
    a_takeover_while_offloads_are_in_flight_loads_whole_blocks(executor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_takeover_while_offloads_are_in_flight_loads_whole_blocks(
    model_dir: Path,
) -> None:
    cuda = make_executor(model_dir, HOST_KV_GIB, device="cuda", backend="triton")
    a_takeover_while_offloads_are_in_flight_loads_whole_blocks(cuda)


def test_an_offloaded_block_takes_its_sources_tag_for_a_takeover_to_list(
    executor: Executor,
) -> None:
    fresh(executor)
    prefilled(executor, [1, 2])
    executor.step(moving(tag_block_ids=[1], tag_block_hashes=[b"p1"], tag_group_ids=[0]))
    executor.step(moving(offloads=((1, 4), (2, 5))))  # block 2 has no tag: host 5 gets none
    listing = executor.list_cached_blocks(executor_pb2.ListCachedBlocksRequest(owner=OWNER))
    assert [(list(c.block_ids), list(c.host_block_ids)) for c in listing] == [([1], []), ([], [4])]
    assert list(listing[1].host_block_hashes) == [b"p1"]
    assert list(listing[1].host_group_ids) == [0]
    executor.step(moving(offloads=((2, 4),)))  # overwritten from an untagged block
    listing = executor.list_cached_blocks(executor_pb2.ListCachedBlocksRequest(owner=OWNER))
    assert all(not c.host_block_ids for c in listing)
    executor.step(moving(offloads=((1, 4),)))
    executor.reset(executor_pb2.ResetRequest(owner=OWNER))  # kept
    listing = executor.list_cached_blocks(executor_pb2.ListCachedBlocksRequest(owner=OWNER))
    assert [list(c.host_block_ids) for c in listing] == [[], [4]]
    fresh(executor)  # drop_cached_blocks: the host tags go too
    listing = executor.list_cached_blocks(executor_pb2.ListCachedBlocksRequest(owner=OWNER))
    assert listing == []
