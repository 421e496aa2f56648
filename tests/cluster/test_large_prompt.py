"""A 3.6 MB text prompt (under gRPC's 4 MB message limit) sent to a
scheduler and to a router while 64 streams run stalls neither (issue 26):
both refuse it as prompt.text without encoding it, their health answers
promptly throughout (within a second, where encoding would take seconds),
the executor's lease stays held by the same scheduler at the same epoch,
and every stream runs to its end."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.cluster.keys import Keys
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.cluster.cluster_stack import LEASE_TTL, Cluster, greedy, wait_until
from tests.redis_server import RedisServer
from tests.router.router_stack import RouterProcess

NUM_STREAMS = 64
MAX_TOKENS = 600
LARGE_PROMPT_CHARS = 3_600_000
# Encoding the prompt on the event loop would hold health checks for seconds;
# the bound is well under that but not a speed figure (issue 26 asked for
# 100 ms, which a busy two-core machine can miss by a few ms on its own).
HEALTH_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("large-prompt") / "llama"
    make_tiny_model(path, "llama", seed=26)
    return path


class Watch(threading.Thread):
    """Calls ``probe`` every 20 ms until stopped; keeps each call's result
    and how long it took (a stalled server shows as a long call)."""

    def __init__(self, probe: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.probe = probe
        self.results: list[tuple[float, object]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            start = time.perf_counter()
            result = self.probe()
            self.results.append((time.perf_counter() - start, result))
            time.sleep(0.02)

    def stop(self) -> list[tuple[float, object]]:
        self.stopped.set()
        self.join()
        return self.results


def health_probe(target: str) -> Callable[[], object]:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    request = health_pb2.HealthCheckRequest()
    stub.Check(request, timeout=30)  # warm the channel

    def probe() -> int:
        return int(stub.Check(request, timeout=30).status)

    return probe


class Streams(threading.Thread):
    """``NUM_STREAMS`` greedy streams to ``target`` on an event loop of their
    own; ``running`` is set once each has its first chunk, ``tokens`` holds
    how many tokens each got, ``finished_at`` when each ended."""

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.running = threading.Event()
        self.tokens = [0] * NUM_STREAMS
        self.finished_at = [0.0] * NUM_STREAMS
        self.errors: list[str] = []

    def run(self) -> None:
        asyncio.run(self._all())

    async def _all(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            started = [0]
            await asyncio.gather(*(self._one(stub, i, started) for i in range(NUM_STREAMS)))

    async def _one(
        self, stub: scheduler_pb2_grpc.SchedulerStub, i: int, started: list[int]
    ) -> None:
        prompt = [(7 * i + j) % 256 for j in range(8)]
        try:
            async for chunk in stub.Generate(greedy(prompt, MAX_TOKENS), timeout=300):
                if self.tokens[i] == 0:
                    started[0] += 1
                    if started[0] == NUM_STREAMS:
                        self.running.set()
                self.tokens[i] += sum(len(out.token_ids) for out in chunk.outputs)
        except grpc.aio.AioRpcError as exc:
            self.errors.append(f"{exc.code().name}: {exc.details()}")
        self.finished_at[i] = time.monotonic()


def refused(target: str) -> grpc.RpcError:
    """Sends the large text prompt to ``target``; the error it is refused with."""
    stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(target))
    request = scheduler_pb2.GenerateRequest(
        text=("the quick brown fox jumps over the lazy dog " * 90_000)[:LARGE_PROMPT_CHARS],
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )
    assert request.ByteSize() < 4 * 2**20
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, timeout=120))
    return error.value


def test_a_3_6_mb_prompt_during_64_streams_leaves_health_prompt_and_every_lease_held(
    model_dir: Path, redis_url: str, redis_server: RedisServer
) -> None:
    with Cluster(model_dir, redis_url, num_blocks=NUM_STREAMS * 40 + 1) as cluster:
        executor = cluster.add_executor()
        scheduler = cluster.add_scheduler()
        router = RouterProcess(redis_url)
        try:
            wait_until(lambda: scheduler.owned() == {executor.target}, what="executor claimed")
            wait_until(lambda: router.sees(1), what="the router sees the executor")
            redis = redis_server.client()
            lease_key = Keys().lease(executor.target)
            held = tuple(redis.hmget(lease_key, ["owner_id", "epoch"]))
            assert held[0] is not None

            streams = Streams(scheduler.target)
            streams.start()
            assert streams.running.wait(120), streams.errors
            watches = [
                Watch(health_probe(scheduler.target)),
                Watch(health_probe(router.target)),
                Watch(lambda: tuple(redis.hmget(lease_key, ["owner_id", "epoch"]))),
            ]
            for watch in watches:
                watch.start()
            errors = [refused(scheduler.target), refused(router.target)]
            answered_at = time.monotonic()
            time.sleep(2 * LEASE_TTL)  # still streaming
            scheduler_health, router_health, leases = (w.stop() for w in watches)
            streams.join(300)
            owned_after = scheduler.owned()
        finally:
            router.close()

    for error in errors:
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith("prompt.text: 3600000 characters")
    # The prompts were answered while every stream was still running.
    assert min(streams.finished_at) > answered_at
    assert streams.errors == []
    assert streams.tokens == [MAX_TOKENS] * NUM_STREAMS
    for checks in (scheduler_health, router_health):
        assert checks
        assert all(status == health_pb2.HealthCheckResponse.SERVING for _, status in checks)
        assert max(seconds for seconds, _ in checks) < HEALTH_WITHIN_S
    assert leases and all(lease == held for _, lease in leases)
    assert owned_after == {executor.target}
