"""Ports that are really ours (issue 26, real processes): a port in use is an
error naming it, exit 2, for every server and for ``--metrics-port`` and
``--health-port`` (gRPC servers shared a port: SO_REUSEPORT); a scheduler on
``--port 0`` never advertises port 0 in Redis."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pagedkv.cluster.keys import Keys
from pagedkv.cluster.members import MemberRecord
from pagedkv.executor.tiny_model import make_tiny_model
from tests.cluster.cluster_stack import SchedulerProcess, wait_until
from tests.redis_server import RedisServer

CLI = [sys.executable, "-m", "pagedkv.common.cli"]
NO_REDIS = "redis://127.0.0.1:1/0"  # never dialled: the ports are taken first


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port of 127.0.0.1 held as a gRPC server holds one (listening, with
    SO_REUSEPORT, which let a second gRPC server bind it too)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("ports") / "llama"
    make_tiny_model(path, "llama", seed=3)
    return path


def refused(args: list[str], flag: str, port: int) -> None:
    """``pagedkv ARGS`` exits 2 at once, saying in one line that ``flag``'s
    ``port`` is in use, with no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"{flag} {port}: 127.0.0.1:{port} in use" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "ready" not in result.stdout


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--health-port"])
def test_a_scheduler_refuses_a_port_in_use(held_port: int, flag: str) -> None:
    ports = {"--port": "0", "--metrics-port": "0", flag: str(held_port)}
    args = ["scheduler", "--redis-url", NO_REDIS]
    refused([*args, *(x for item in ports.items() for x in item)], flag, held_port)


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--health-port"])
def test_a_router_refuses_a_port_in_use(held_port: int, flag: str) -> None:
    ports = {"--port": "0", "--metrics-port": "0", flag: str(held_port)}
    args = ["router", "--redis-url", NO_REDIS]
    refused([*args, *(x for item in ports.items() for x in item)], flag, held_port)


@pytest.mark.parametrize("flag", ["--port", "--health-port"])
def test_an_executor_refuses_a_port_in_use(held_port: int, flag: str, model_dir: Path) -> None:
    ports = {"--port": "0", flag: str(held_port)}
    args = ["executor", "--model", str(model_dir), "--device", "cpu"]
    refused([*args, *(x for item in ports.items() for x in item)], flag, held_port)


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_serve_refuses_a_port_in_use_before_it_starts_anything(
    held_port: int, flag: str, model_dir: Path
) -> None:
    ports = {"--port": "0", flag: str(held_port)}
    args = ["serve", "--model", str(model_dir), "--device", "cpu"]
    refused([*args, *(x for item in ports.items() for x in item)], flag, held_port)


def test_a_second_scheduler_on_a_scheduler_s_port_is_refused() -> None:
    with RedisServer() as redis_server, SchedulerProcess(redis_server.url) as first:
        port = int(first.target.rpartition(":")[2])
        refused(["scheduler", "--redis-url", redis_server.url, "--port", str(port)], "--port", port)
        assert first.process.poll() is None
        assert first.stats().scheduler_id  # the first one still serves


def test_a_scheduler_on_port_0_registers_only_the_port_it_bound() -> None:
    # Every command Redis runs is watched (MONITOR) from before the
    # scheduler starts until its member record is in: none names port 0.
    with RedisServer() as redis_server:
        watcher = redis.Redis.from_url(redis_server.url)
        commands: list[str] = []
        with watcher.monitor() as monitor:
            listening = threading.Event()

            def watch() -> None:
                listening.set()
                with contextlib.suppress(redis.ConnectionError, ValueError):  # closed
                    for command in monitor.listen():
                        commands.append(str(command["command"]))

            threading.Thread(target=watch, daemon=True).start()
            listening.wait()
            with SchedulerProcess(redis_server.url) as scheduler:
                port = scheduler.target.rpartition(":")[2]
                client = redis.Redis.from_url(redis_server.url)
                keys = Keys()

                def registered() -> list[MemberRecord]:
                    ids = [i.decode() for i in client.smembers(keys.schedulers())]
                    values = [client.get(keys.scheduler(i)) for i in ids]
                    return [MemberRecord.from_json(v) for v in values if v is not None]

                wait_until(lambda: bool(registered()), what="the member record")
                assert [r.address for r in registered()] == [f"127.0.0.1:{port}"]
                wait_until(lambda: any(port in c for c in commands), what="its write seen")
                client.close()
        watcher.close()
    written = [c for c in commands if "127.0.0.1:" in c]
    assert written
    assert not [c for c in written if re.search(r"127\.0\.0\.1:0(?!\d)", c)]
