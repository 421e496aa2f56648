"""A cluster of real processes on 127.0.0.1 for the cluster tests: a private
redis-server (the module's ``redis_server`` fixture), executors that register
there (``pagedkv executor --redis-url``) and schedulers that find them there
(``pagedkv scheduler --redis-url``)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pagedkv.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.executor.driver import ExecutorProcess
from tests.processes import ServedProcess

LEASE_TTL = 2.0  # seconds; short, so that expiries fit in a test


class SchedulerProcess(ServedProcess):
    """``pagedkv scheduler --redis-url URL``; ``stub`` is its Scheduler stub."""

    def __init__(self, redis_url: str, *extra: str, lease_ttl: float = LEASE_TTL) -> None:
        command = [sys.executable, "-m", "pagedkv.common.cli", "scheduler"]
        command += ["--redis-url", redis_url, "--port", "0", "--lease-ttl", str(lease_ttl)]
        command += ["--executor-timeout", "20", *extra]
        super().__init__(command, timeout=120)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        response: scheduler_pb2.GetStatsResponse = self.stub.GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=30
        )
        return response

    @property
    def scheduler_id(self) -> str:
        return self.stats().scheduler_id

    def owned(self) -> set[str]:
        """Addresses of the executors this scheduler has in service."""
        return {e.address for e in self.stats().executors if e.healthy}

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)


class Cluster:
    """Executors and schedulers of one cluster; ``close`` stops them all."""

    def __init__(self, model_dir: Path, redis_url: str, *, num_blocks: int = 128) -> None:
        self.model_dir = model_dir
        self.redis_url = redis_url
        self.num_blocks = num_blocks
        self.executors: list[ExecutorProcess] = []
        self.schedulers: list[SchedulerProcess] = []

    def add_executor(self, *extra: str) -> ExecutorProcess:
        args = ("--redis-url", self.redis_url, "--max-num-rows", "64", *extra)
        executor = ExecutorProcess(self.model_dir, num_blocks=self.num_blocks, extra_args=args)
        self.executors.append(executor)
        return executor

    def add_scheduler(self, *extra: str) -> SchedulerProcess:
        scheduler = SchedulerProcess(self.redis_url, *extra)
        self.schedulers.append(scheduler)
        return scheduler

    def live_schedulers(self) -> list[SchedulerProcess]:
        return [s for s in self.schedulers if s.process.poll() is None]

    def ownership(self) -> dict[str, list[str]]:
        """Executor address -> the live schedulers that have it in service."""
        owners: dict[str, list[str]] = {e.target: [] for e in self.executors}
        for scheduler in self.live_schedulers():
            stats = scheduler.stats()
            for executor in stats.executors:
                if executor.healthy:
                    owners.setdefault(executor.address, []).append(stats.scheduler_id)
        return owners

    def each_owned_once(self) -> bool:
        """Every live executor is in service on exactly one live scheduler."""
        live = {e.target for e in self.executors if e.process.poll() is None}
        owners = self.ownership()
        return all(len(owners.get(address, [])) == 1 for address in live)

    def balanced(self) -> bool:
        """Every live executor in service once, and every live scheduler
        holding its share (rebalancing gives a scheduler that joined after
        the others took every executor its share a moment later)."""
        live = [e for e in self.executors if e.process.poll() is None]
        schedulers = self.live_schedulers()
        if not schedulers or not self.each_owned_once():
            return False
        share = len(live) // len(schedulers)
        held = [sum(e.healthy for e in s.stats().executors) for s in schedulers]
        return all(count >= share for count in held)

    def close(self) -> None:
        for process in [*self.schedulers, *self.executors]:
            process.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def greedy(
    prompt: list[int], max_tokens: int, request_id: str = ""
) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=scheduler_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "") -> float:
    """Polls ``condition``; returns the seconds it took. AssertionError past a
    generous deadline."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"not met before the deadline: {what}"
        time.sleep(0.05)
    return time.monotonic() - start
