"""A real ``pagedkv executor --redis-url`` process in the registry: it appears
with its incarnation once it serves, SIGTERM unregisters it, SIGKILL leaves
its record to expire, and a Redis that is down at start only delays the
registration (the executor serves anyway)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from pagedkv.cluster.connection import connect
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.registry import ExecutorRecord, list_executors
from pagedkv.executor.tiny_model import make_tiny_model
from pagedkv.v1 import executor_pb2
from tests.cluster.conftest import run, wait_until
from tests.executor.driver import ExecutorProcess
from tests.redis_server import RedisServer

NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("registration") / "llama"
    make_tiny_model(path, "llama", seed=7)
    return path


def listed(url: str) -> list[ExecutorRecord]:
    return run(list_executors(connect(url)))


def start(model_dir: Path, url: str, *extra: str) -> ExecutorProcess:
    args = ("--redis-url", url, "--max-num-rows", "4", "--max-model-len", "128", *extra)
    return ExecutorProcess(model_dir, num_blocks=NUM_BLOCKS, extra_args=args)


def test_an_executor_registers_its_incarnation_and_sigterm_unregisters_it(
    model_dir: Path, redis_url: str
) -> None:
    with start(model_dir, redis_url) as process:
        info = process.stub.GetInfo(executor_pb2.GetInfoRequest())
        wait_until(lambda: len(listed(redis_url)) == 1)
        (record,) = listed(redis_url)
        assert record == ExecutorRecord(
            address=process.target,
            incarnation_id=info.incarnation_id,
            model_id=info.model_id,
            block_size=16,
            num_blocks=NUM_BLOCKS,
            bytes_per_block=info.bytes_per_block,
            max_num_rows=4,
            max_model_len=128,
            registered_at_ms=record.registered_at_ms,
        )
        process.process.send_signal(signal.SIGTERM)
        assert process.process.wait(timeout=60) == 0
    assert listed(redis_url) == []
    assert not run(connect(redis_url).exists(Keys().executors()))


def test_a_killed_executor_expires_from_the_registry(model_dir: Path, redis_url: str) -> None:
    with start(model_dir, redis_url) as process:
        wait_until(lambda: [r.address for r in listed(redis_url)] == [process.target])
        process.process.send_signal(signal.SIGKILL)
        process.process.wait(timeout=60)
        client = connect(redis_url)
        assert run(client.exists(Keys().executor(process.target))) == 1  # until its TTL ends
        wait_until(lambda: listed(redis_url) == [])


def test_an_executor_serves_while_redis_is_down_and_registers_when_it_is_up(
    model_dir: Path, redis_url: str, redis_server: RedisServer
) -> None:
    redis_server.kill()
    advertised = "executor-7.example:50061"
    with start(model_dir, redis_url, "--advertise-address", advertised) as process:
        info = process.stub.GetInfo(executor_pb2.GetInfoRequest())  # serving
        # It has tried Redis and says so (before Redis is back, or the
        # registration could succeed at its first try).
        wait_until(lambda: "redis unreachable" in process.stderr())
        redis_server.start()
        wait_until(lambda: [r.address for r in listed(redis_url)] == [advertised])
        assert listed(redis_url)[0].incarnation_id == info.incarnation_id
        process.process.send_signal(signal.SIGINT)
        assert process.process.wait(timeout=60) == 0
    assert listed(redis_url) == []


def test_a_bad_redis_url_is_refused_naming_the_flag(model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="--redis-url http://x: the scheme"):
        start(model_dir, "http://x")
