"""``pagedkv serve`` as a cluster: ``--redis-url URL`` (or ``--redis``, a
private redis-server) with ``--schedulers N``. Every scheduler prints a ready
line, serves Hugging Face's greedy output, and the executors are each in
service on exactly one of them; SIGTERM leaves no child behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import grpc
import pytest

from pagedkv.common.cli import main
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.cluster.cluster_stack import LEASE_TTL, greedy, wait_until
from tests.executor.test_generation import hf_greedy

pytestmark = pytest.mark.slow  # pagedkv serve clusters started and stopped

PROMPT = list(range(5, 30))
READY = re.compile(r"pagedkv serve scheduler (\d+)/(\d+) ready on ([\d.]+:\d+)")
ROUTER_READY = re.compile(r"pagedkv serve router (\d+)/(\d+) ready on ([\d.]+:\d+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("serve-cluster") / "llama"
    make_tiny_model(path, "llama", seed=11)
    return path


class ServedCluster:
    """``pagedkv serve ... --schedulers N --port 0``, once all N schedulers
    (and ``num_routers`` routers) printed their ready line; ``stubs`` in the
    order of the lines' labels, ``router_targets`` likewise."""

    def __init__(
        self, model_dir: Path, num_schedulers: int, *extra: str, num_routers: int = 0
    ) -> None:
        command = [sys.executable, "-m", "pagedkv.common.cli", "serve", "--model", str(model_dir)]
        command += ["--schedulers", str(num_schedulers), "--port", "0", "--num-blocks", "128"]
        command += ["--lease-ttl", str(LEASE_TTL), "--executor-timeout", "20", *extra]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line)
                if len(self.ready_lines()) == num_schedulers and (
                    len(self.ready_lines(ROUTER_READY)) == num_routers
                ):
                    ready.set()
            ready.set()  # the process ended

        threading.Thread(target=read, daemon=True).start()
        ready.wait(300)
        found = self.ready_lines()
        routers = self.ready_lines(ROUTER_READY)
        if len(found) != num_schedulers or len(routers) != num_routers:
            self.log.seek(0)
            errors = self.log.read()[-4000:]
            self.close()
            raise RuntimeError(f"pagedkv serve did not start: {self.lines} {errors}")
        assert [label for label, _ in found] == [
            f"{i}/{num_schedulers}" for i in range(1, 1 + num_schedulers)
        ]
        self.targets = [target for _, target in found]
        self.router_targets = [target for _, target in routers]
        self.channels = [grpc.insecure_channel(target) for target in self.targets]
        self.stubs = [scheduler_pb2_grpc.SchedulerStub(channel) for channel in self.channels]

    def ready_lines(self, pattern: re.Pattern[str] = READY) -> list[tuple[str, str]]:
        """(label, target) of each ready line so far."""
        matches = [pattern.search(line) for line in self.lines]
        return [(f"{m.group(1)}/{m.group(2)}", m.group(3)) for m in matches if m]

    def stats(self, i: int) -> scheduler_pb2.GetStatsResponse:
        response: scheduler_pb2.GetStatsResponse = self.stubs[i].GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=30
        )
        return response

    def owned(self) -> list[set[str]]:
        """Per scheduler, the executors it has in service."""
        return [
            {e.address for e in self.stats(i).executors if e.healthy}
            for i in range(len(self.stubs))
        ]

    def close(self) -> None:
        for channel in getattr(self, "channels", []):
            channel.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _descendants(pid: int) -> set[int]:
    """The running processes below ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _check_cluster(served: ServedCluster, model_dir: Path, num_executors: int) -> None:
    """Each executor in service on one scheduler, every scheduler showing the
    whole cluster and answering with Hugging Face's greedy tokens."""

    def partitioned() -> bool:
        owned = served.owned()
        return all(owned) and sum(map(len, owned)) == len(set().union(*owned)) == num_executors

    wait_until(partitioned, what="each executor in service on exactly one scheduler")
    ids = sorted(served.stats(i).scheduler_id for i in range(len(served.stubs)))
    expected = hf_greedy(model_dir, PROMPT, 10)
    for i, stub in enumerate(served.stubs):
        wait_until(  # a view is as old as the member's last round
            lambda i=i: all(e.owner_id in ids for e in served.stats(i).cluster.executors),
            what="every executor leased in the scheduler's view",
        )
        view = served.stats(i).cluster
        assert view.enabled and not view.degraded
        assert sorted(view.scheduler_ids) == ids
        assert len(view.executors) == num_executors
        tokens = [
            t
            for chunk in stub.Generate(greedy(PROMPT, 10), timeout=120)
            for out in chunk.outputs
            for t in out.token_ids
        ]
        assert tokens == expected, f"scheduler {i + 1}"


def test_serve_with_a_redis_url_runs_two_schedulers_over_three_executors(
    model_dir: Path, redis_url: str
) -> None:
    served = ServedCluster(model_dir, 2, "--redis-url", redis_url, "--executors", "3")
    try:
        _check_cluster(served, model_dir, 3)
    finally:
        served.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_serve_with_a_private_redis_and_a_router_and_sigterm_leaves_no_child(
    model_dir: Path,
) -> None:
    # A short drain: the stop under test ends sooner (test_serve_stop.py says why).
    served = ServedCluster(
        model_dir,
        2,
        "--redis",
        "--executors",
        "2",
        "--routers",
        "1",
        "--drain-timeout",
        "5",
        num_routers=1,
    )
    try:
        _check_cluster(served, model_dir, 2)
        with grpc.insecure_channel(served.router_targets[0]) as channel:
            router = scheduler_pb2_grpc.SchedulerStub(channel)
            chunks = list(router.Generate(greedy(PROMPT, 10), timeout=120))
            stats = router.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
        tokens = [t for chunk in chunks for out in chunk.outputs for t in out.token_ids]
        assert tokens == hf_greedy(model_dir, PROMPT, 10)
        assert chunks[0].placement.hint == scheduler_pb2.PLACEMENT_HINT_HONOURED
        assert stats.router.policy == "kv" and len(stats.cluster.scheduler_ids) == 2
        children = _descendants(served.process.pid)
        names = []
        for pid in children:
            with open(f"/proc/{pid}/comm") as comm:
                names.append(comm.read().strip())
        assert sorted(names).count("redis-server") == 1
        assert len(children) >= 5  # redis, 2 executors, 1 scheduler, 1 router
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=90) == 0
        assert not [pid for pid in children if _alive(pid)]
    finally:
        served.close()


def test_several_schedulers_without_redis_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--schedulers", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pagedkv serve: --schedulers 2 needs a cluster: give --redis-url URL "
        "or --redis (a private redis-server)"
    )


def test_routers_without_redis_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--routers", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pagedkv serve: --routers 1 needs a cluster: give --redis-url URL "
        "or --redis (a private redis-server)"
    )


def test_bad_router_weights_are_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--router-weights", "1,x,2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pagedkv serve: --router-weights 1,x,2: three weights >= 0, then optionally a load "
        "bound >= 1 and a load slack >= 0, PREFIX,LOAD,KV[,BOUND[,SLACK]]"
    )
    assert main(["serve", "--router-weights", "1,0.5,0.5,0.8"]) == 2
    assert "a load bound >= 1" in capsys.readouterr().err


def test_redis_and_a_redis_url_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--redis", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "not both" in capsys.readouterr().err


def test_redis_without_redis_server_on_the_path_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["serve", "--redis"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("pagedkv serve: --redis: redis-server is not installed")
