"""Schedulers fail, pause, join and leave a running cluster under load
(issue 11, real processes): SIGKILL (the leases expire, the survivor adopts
the executors with their cached prefixes, the SDK resumes every broken
stream), SIGSTOP past the lease TTL (the paused member loses its leases and
stops stepping), a third member joining (rebalanced to 1/1/1) and SIGTERM
(drained, released, claimed at once). Every greedy output equals Hugging
Face's, and the live schedulers' pools pass their integrity checks."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedkv.client import AsyncClient
from pagedkv.executor.tiny_model import make_tiny_model
from tests.cluster.cluster_stack import LEASE_TTL, Cluster, SchedulerProcess, greedy, wait_until

MAX_TOKENS = 24
NUM_BLOCKS = 512  # room for every prompt of a test: nothing cached is evicted


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("failover") / "llama"
    make_tiny_model(path, "llama", seed=11)
    return path


def prompt_families(seed: int, num_families: int, per_family: int, prefix: int) -> list[list[int]]:
    """``num_families * per_family`` prompts: each family shares a ``prefix``
    token prefix (whole 16-token blocks, so its members hit the prefix
    cache), then 3 to 9 tokens of its own."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_families):
        shared = [rng.randrange(256) for _ in range(prefix)]
        for _ in range(per_family):
            prompts.append(shared + [rng.randrange(256) for _ in range(rng.randrange(3, 10))])
    return prompts


class References:
    """Hugging Face greedy continuations, the model loaded once."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.model.generation_config.eos_token_id = None
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], num_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(prompt), num_tokens)
        if key not in self.cache:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False
                )
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> References:
    return References(model_dir)


@pytest.fixture
def cluster(model_dir: Path, redis_url: str) -> Iterator[Cluster]:
    with Cluster(model_dir, redis_url, num_blocks=NUM_BLOCKS) as cluster:
        yield cluster


def counts(cluster: Cluster) -> list[int]:
    """How many executors each live scheduler has in service, sorted."""
    return sorted(len(s.owned()) for s in cluster.live_schedulers())


def balanced(cluster: Cluster, expected: list[int]) -> bool:
    return cluster.each_owned_once() and counts(cluster) == expected


def start(cluster: Cluster, num_schedulers: int = 2, num_executors: int = 3) -> None:
    """Starts the cluster and waits until its executors are in service once
    each, spread over the schedulers (2 and 1 for 2 schedulers and 3)."""
    for _ in range(num_executors):
        cluster.add_executor()
    for _ in range(num_schedulers):
        cluster.add_scheduler()
    share, extra = divmod(num_executors, num_schedulers)
    expected = sorted([share] * (num_schedulers - extra) + [share + 1] * extra)
    wait_until(lambda: balanced(cluster, expected), what=f"executors in service as {expected}")


def generate_ids(
    scheduler: SchedulerProcess, prompt: list[int], max_tokens: int
) -> tuple[list[int], int]:
    """One greedy request straight to ``scheduler``: its tokens and
    ``usage.cached_prompt_tokens``."""
    tokens: list[int] = []
    cached = -1
    for chunk in scheduler.stub.Generate(greedy(prompt, max_tokens), timeout=120):
        for out in chunk.outputs:
            tokens.extend(out.token_ids)
        if chunk.HasField("usage"):
            cached = chunk.usage.cached_prompt_tokens
    return tokens, cached


def assert_healthy(scheduler: SchedulerProcess, *, idle: bool = True) -> None:
    """Integrity ok, no internal error, and (``idle``) no block held."""
    stats = scheduler.stats()
    assert stats.integrity.ok, stats.integrity.message
    assert stats.num_internal_errors == 0
    if idle:
        assert stats.num_running == stats.num_waiting == 0
        for executor in stats.executors:
            if executor.healthy:
                assert executor.num_free_blocks == executor.num_usable_blocks, executor.address


def log_events(scheduler: SchedulerProcess, event: str) -> list[dict[str, object]]:
    """The scheduler's JSON log records whose event is ``event``."""
    records = []
    for line in scheduler.stderr().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                records.append(record)
    return records


def test_a_killed_scheduler_s_executors_are_adopted_with_their_cache_and_every_stream_resumes(
    cluster: Cluster, hf: References
) -> None:
    start(cluster)
    first, second = cluster.schedulers
    victim, survivor = (first, second) if len(first.owned()) == 2 else (second, first)
    doomed = victim.owned()
    assert len(doomed) == 2 and len(survivor.owned()) == 1
    # Cached on the victim's executors only: replayed there, then on the survivor.
    replay = prompt_families(seed=1, num_families=2, per_family=4, prefix=64)
    for prompt in replay:
        assert generate_ids(victim, prompt, 4)[0] == hf(prompt, 4)
    hits_before = sum(generate_ids(victim, prompt, 4)[1] for prompt in replay)
    assert hits_before >= len(replay) * 48

    prompts = prompt_families(seed=2, num_families=4, per_family=12, prefix=48)
    received = 0
    kill_at = threading.Event()
    killed = threading.Event()
    adopted_after: list[float] = []

    def kill_and_watch() -> None:
        kill_at.wait(300)
        assert victim.stats().num_running > 0
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        killed.set()
        while True:
            sent = time.monotonic()
            if doomed <= survivor.owned():  # measured from the poll that saw it sent
                adopted_after.append(sent - killed_at)
                return
            assert sent - killed_at < 60, "not adopted"
            time.sleep(0.05)

    async def one(client: AsyncClient, prompt: list[int]) -> list[int]:
        nonlocal received
        tokens: list[int] = []
        async for chunk in client.generate(
            token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
        ):
            for seq in chunk.sequences:
                tokens.extend(seq.token_ids)
                received += len(seq.token_ids)
            if received >= len(prompts) * MAX_TOKENS // 4:
                kill_at.set()
        return tokens

    async def load() -> tuple[list[list[int]], int]:
        async with AsyncClient([victim.target, survivor.target], timeout=300) as client:
            outputs = await asyncio.gather(*(one(client, p) for p in prompts))
            return list(outputs), client.num_resumes

    watcher = threading.Thread(target=kill_and_watch, daemon=True)
    watcher.start()
    outputs, num_resumes = asyncio.run(load())
    watcher.join(60)
    assert killed.is_set() and adopted_after
    assert num_resumes > 0  # streams were broken mid-generation and resumed
    assert outputs == [hf(p) for p in prompts]
    # Leases expire one TTL after their last renewal; adopted at the next round.
    assert adopted_after[0] <= LEASE_TTL + 1.0, adopted_after

    stats = survivor.stats()
    adopted = {e.address: e for e in stats.executors if e.address in doomed}
    assert all(e.healthy and e.num_adopted_cached_blocks > 0 for e in adopted.values())
    hits_after = 0
    for prompt in replay:
        tokens, cached = generate_ids(survivor, prompt, 4)
        assert tokens == hf(prompt, 4)
        hits_after += cached
    assert hits_after >= 0.9 * hits_before, (hits_after, hits_before)
    assert_healthy(survivor)
    assert cluster.each_owned_once()
