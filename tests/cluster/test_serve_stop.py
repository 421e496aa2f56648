"""Stopping ``pagedkv serve --redis`` with schedulers and a router, under
load: a SIGTERM stops everything cleanly, a second signal forces the stop,
and a SIGKILL of ``pagedkv serve`` takes its children with it; no child, no
temporary directory is left behind. Also what the private Redis and the ready
lines of such a cluster show."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import grpc
import pytest
import redis

from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import scheduler_pb2_grpc
from tests.cluster.cluster_stack import LEASE_TTL, greedy, wait_until
from tests.cluster.test_serve_cluster import _alive, _descendants

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or not Path("/proc").is_dir(),
    reason="needs redis-server and Linux's /proc",
)

TEMPORARY = re.compile(r"model (/\S+pagedkv-tiny-[^\s,)]+)")
ROUTER = re.compile(r"pagedkv serve router 1/1 ready on ([\d.]+:\d+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("serve-stop") / "llama"
    make_tiny_model(path, "llama", seed=11)
    return path


class Served:
    """``pagedkv serve --redis --executors 2 --schedulers 2 --routers 1`` on
    free ports, once every ready line is out (``lines``); ``model``: ``--model
    DIR``, or nothing (a temporary tiny model)."""

    def __init__(self, *model: str) -> None:
        command = [sys.executable, "-m", "pagedkv.common.cli", "serve", *model, "--redis"]
        command += ["--executors", "2", "--schedulers", "2", "--routers", "1", "--port", "0"]
        command += ["--num-blocks", "128", "--lease-ttl", str(LEASE_TTL)]
        # A short drain: these tests are about stops that end, and a stop that
        # drains (running requests up to the drain timeout, a child given
        # the drain timeout and a grace before SIGKILL) takes a minute at
        # the default 30 s, which a busy machine stretches past the bounds.
        command += ["--drain-timeout", "5"]
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
                if "pagedkv serve router 1/1 ready" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(300)
        match = next((ROUTER.search(line) for line in self.lines if ROUTER.search(line)), None)
        if match is None:
            errors = self.stderr()[-4000:]
            self.close()
            raise RuntimeError(f"pagedkv serve did not start: {self.lines} {errors}")
        self.router = match.group(1)

    def stderr(self) -> str:
        fd = self.log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


class Load:
    """Streams through the router, one after another on each of ``num``
    threads until ``stop``; a stream that breaks (the cluster stopping)
    ends its thread."""

    def __init__(self, target: str, num: int = 4) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.num_chunks = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        try:
            while True:
                for _ in self.stub.Generate(greedy(list(range(5, 40)), 200), timeout=120):
                    self.num_chunks += 1
        except grpc.RpcError:
            return

    def close(self) -> None:
        self.channel.close()
        for thread in self.threads:
            thread.join(timeout=30)


def _redis_dir(pids: set[int]) -> Path:
    """The private Redis' directory: its working directory (``--dir``)."""
    for pid in pids:
        with open(f"/proc/{pid}/comm") as comm:
            if comm.read().strip() == "redis-server":
                return Path(os.readlink(f"/proc/{pid}/cwd"))
    raise AssertionError("no redis-server among the children")


def _under_load(served: Served) -> Load:
    load = Load(served.router)
    wait_until(lambda: load.num_chunks > 0, what="streams flowing through the router")
    return load


def _left_behind(children: set[int], directories: list[Path]) -> bool:
    return not any(_alive(pid) for pid in children) and not any(d.exists() for d in directories)


def test_sigkill_of_serve_takes_its_children_and_temporary_directories_with_it() -> None:
    served = Served()
    try:
        model = Path(TEMPORARY.findall("".join(served.lines))[0])
        children = _descendants(served.process.pid)
        directories = [model, _redis_dir(children)]
        assert all(d.is_dir() and d.name.startswith("pagedkv-") for d in directories)
        load = _under_load(served)
        served.process.send_signal(signal.SIGKILL)
        served.process.wait()
        wait_until(
            lambda: _left_behind(children, directories),
            what="no child and no temporary directory left after SIGKILL",
        )
        load.close()
    finally:
        served.close()


def _child_scheduler(pids: set[int]) -> int:
    """The child ``pagedkv scheduler`` among ``pids`` (from its command line)."""
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            args = cmdline.read().decode().split("\0")
        if "pagedkv.common.cli" in args and "scheduler" in args:
            return pid
    raise AssertionError("no child scheduler among the children")


def test_a_second_signal_forces_a_stop_that_hangs_under_load(model_dir: Path) -> None:
    """A stopped child scheduler hangs the clean stop (its grace is the drain
    timeout and more), as the stop that hung did; a second signal ends it."""
    served = Served("--model", str(model_dir))
    try:
        children = _descendants(served.process.pid)
        directories = [_redis_dir(children)]
        load = _under_load(served)
        os.kill(_child_scheduler(children), signal.SIGSTOP)  # SIGTERM can reach it no more
        served.process.send_signal(signal.SIGTERM)
        wait_until(lambda: "scheduler stopping" in served.stderr(), what="the clean stop begun")
        assert served.process.poll() is None  # held by the stopped child
        served.process.send_signal(signal.SIGINT)
        assert served.process.wait(timeout=60) == 1
        assert "SIGINT while stopping: SIGKILL to every child" in served.stderr()
        wait_until(lambda: _left_behind(children, directories), what="nothing left behind")
        load.close()
    finally:
        served.close()


def _stop_cleanly_under_load(served: Served) -> None:
    children = _descendants(served.process.pid)
    directories = [_redis_dir(children)]
    load = _under_load(served)
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=120) == 0, served.stderr()[-3000:]
    load.close()
    wait_until(lambda: _left_behind(children, directories), what="nothing left behind")


def _check_private_redis(served: Served) -> None:
    """It requires a password, found in a file only this user reads and on
    no command line nor in any output."""
    children = _descendants(served.process.pid)
    password_file = _redis_dir(children) / "password"
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    password = password_file.read_text().strip()
    assert len(password) >= 32
    for pid in [served.process.pid, *children]:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            assert password.encode() not in cmdline.read()
    assert password not in served.stderr() + "".join(served.lines)
    port = int(re.findall(r"redis://127\.0\.0\.1:(\d+)", served.stderr())[0])
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, socket_timeout=5).ping()
    assert redis.Redis(port=port, password=password, socket_timeout=5).ping()


def _ready_counts(served: Served) -> list[int]:
    """The executors each scheduler's ready line says it holds."""
    lines = [line for line in served.lines if re.search(r"scheduler \d+/2 ready", line)]
    return [int(m.group(1)) for line in lines if (m := re.search(r"\((\d+) executors", line))]


def test_sigterm_under_load_stops_every_child(model_dir: Path) -> None:
    served = Served("--model", str(model_dir))
    try:
        assert sorted(_ready_counts(served)) == [1, 1], served.lines  # 2 executors in all
        _check_private_redis(served)
        _stop_cleanly_under_load(served)
    finally:
        served.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 20 starts of five processes: 4 minutes idle, more on a busy box
def test_twenty_stops_under_load_never_hang_nor_leave_a_child(model_dir: Path) -> None:
    for _ in range(20):
        served = Served("--model", str(model_dir))
        try:
            _stop_cleanly_under_load(served)
        finally:
            served.close()
